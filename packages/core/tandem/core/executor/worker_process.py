"""The body of a worker process in multi-process mode: join the torch.distributed world, load
this rank's shard, then run every step the engine announces until told to stop."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import FrameType
from typing import Any

import torch.distributed as dist

from tandem.collectives import CollectiveAborted, CollectiveTimeout
from tandem.core.config import EngineConfig
from tandem.core.executor.transport import ShmBroadcastReader
from tandem.core.failure_text import describe
from tandem.core.parallel.collective_choice import resolve_collectives
from tandem.core.parallel.groups import (
    CommunicatorHandles,
    close_communicators,
    join_process_world,
    make_process_group,
)
from tandem.core.worker.step_runner import RunnerFactory
from tandem.core.worker.worker import Worker
from tandem.device import Device, get_runtime

logger = logging.getLogger(__name__)

STOP = "stop"


@dataclass(frozen=True)
class WorkerFailure:
    """What a failed worker process tells the engine before it exits."""

    rank: int
    cause: str
    # time.time() when it failed: the earliest failure of a step is its cause.
    at: float
    # It failed because another rank did (its collective was aborted or timed out).
    consequence: bool = False


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    world_size: int
    device: Device
    cpu_threads: int | None
    master_node_addr: str
    # Shared-memory segment of the engine on this node (None on nodes without the engine).
    shm_name: str | None
    # With several nodes, rank 0 forwards each step to every rank over torch.distributed.
    multi_node: bool


def worker_main(
    spec: WorkerSpec,
    config: EngineConfig,
    runner_factory: RunnerFactory[Any, Any],
    notes: Connection | None,
    results: Connection | None,
) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s rank{spec.rank} %(name)s: %(message)s",
    )
    # The library communicators this process made: closed on every way out (a stop, a
    # failure, the engine's SIGTERM), on threads bound to their devices, after the engine has
    # heard of any failure.
    comms: list[CommunicatorHandles] = []
    signal.signal(signal.SIGTERM, _raise_terminated)
    terminated = False
    # SIGTERMs that arrived once the process was on its way out.
    noted: list[int] = []
    try:
        try:
            _run(spec, config, runner_factory, notes, results, comms)
        finally:
            # On the way out a SIGTERM (the engine stops every rank once one fails) must not
            # cut the report or the closing short: it is noted, and obeyed after them.
            signal.signal(signal.SIGTERM, lambda signum, _: noted.append(signum))
    except _Terminated:
        terminated = True
    except Exception as exc:  # reported to the engine, then the process exits
        logger.exception("worker rank %d failed", spec.rank)
        if results is not None:
            # When it failed, so the engine can tell the first failure (the cause) from the
            # collectives it broke on other ranks.
            consequence = isinstance(exc, (CollectiveAborted, CollectiveTimeout))
            failure = WorkerFailure(spec.rank, describe(exc), time.time(), consequence)
            with contextlib.suppress(OSError):
                results.send(("error", failure))
        raise SystemExit(1) from None
    finally:
        # No thread of this process is inside a collective now: the steps run on this one.
        close_communicators(comms, f"worker rank {spec.rank} is exiting")
    if terminated or noted:
        # Die of the signal after all, so the engine still reads "killed by SIGTERM".
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


class _Terminated(BaseException):
    """SIGTERM arrived: unwind (closing the communicators) instead of dying on the spot."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise _Terminated


def _run(
    spec: WorkerSpec,
    config: EngineConfig,
    runner_factory: RunnerFactory[Any, Any],
    notes: Connection | None,
    results: Connection | None,
    comms: list[CommunicatorHandles],
) -> None:
    timeout = config.parallel.timeout_s
    choice = resolve_collectives(
        config.parallel, spec.device.kind, uses_local=False, uses_process=True
    )
    join_process_world(spec.master_node_addr, spec.world_size, spec.rank, choice, timeout)
    group, handles = make_process_group(
        choice, spec.device, get_runtime(spec.device.kind), spec.rank, spec.world_size, timeout
    )
    comms.append(handles)
    control = dist.new_group(backend="gloo") if spec.multi_node else None
    worker: Worker[Any, Any] = Worker(spec.device, group, config, runner_factory)
    worker.init_device(spec.cpu_threads)
    worker.load_model()
    size = worker.agree_cache_size(worker.determine_cache_size())
    worker.init_kv_cache(size)
    if results is not None:
        results.send(("ready", (size, worker.memory)))
    reader = ShmBroadcastReader(spec.shm_name) if spec.shm_name is not None else None
    while True:
        step: object
        if spec.rank == 0 or not spec.multi_node:
            assert notes is not None and reader is not None
            note = notes.recv()
            step = STOP if note[0] == STOP else pickle.loads(reader.read(note[2]))
        if spec.multi_node:
            box = [step if spec.rank == 0 else None]
            dist.broadcast_object_list(box, src=0, group=control)
            step = box[0]
        if isinstance(step, str) and step == STOP:
            break
        out = worker.execute(step)
        if spec.rank == 0 and results is not None:
            results.send(("out", out))
        elif not spec.multi_node and results is not None:
            # Every rank the engine drives answers, so a step that never ends names the
            # rank it waits for.
            results.send(("done", None))
    if reader is not None:
        reader.close()
    dist.destroy_process_group()
