"""The body of a worker process in multi-process mode: join the torch.distributed world, load
this rank's shard, then run every step the engine announces until told to stop."""

from __future__ import annotations

import contextlib
import logging
import pickle
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch.distributed as dist

from tandem.collectives import ProcessGroup, Rendezvous, TorchDistributedGroup, init_distributed
from tandem.collectives.backends import get_collective_backend
from tandem.core.config import EngineConfig
from tandem.core.executor.transport import ShmBroadcastReader
from tandem.core.llm.forward_input import ForwardInput
from tandem.core.models.model_config import ModelConfig
from tandem.core.parallel.collective_choice import TORCH, resolve_collectives
from tandem.core.worker.worker import Worker
from tandem.device import Device, get_runtime

logger = logging.getLogger(__name__)

STOP = "stop"


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
    model_config: ModelConfig,
    notes: Connection | None,
    results: Connection | None,
) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s rank{spec.rank} %(name)s: %(message)s",
    )
    try:
        _run(spec, config, model_config, notes, results)
    except Exception as exc:  # noqa: BLE001 - reported to the engine, then the process exits
        logger.error("worker rank %d failed: %s", spec.rank, exc)
        if results is not None:
            with contextlib.suppress(OSError):
                results.send(("error", f"rank {spec.rank}: {exc}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None


def _run(
    spec: WorkerSpec,
    config: EngineConfig,
    model_config: ModelConfig,
    notes: Connection | None,
    results: Connection | None,
) -> None:
    timeout = config.parallel.timeout_s
    choice = resolve_collectives(
        config.parallel, spec.device.kind, uses_local=False, uses_process=True
    )
    rdzv = Rendezvous.parse(spec.master_node_addr, spec.world_size, spec.rank)
    init_distributed(rdzv, choice.dist_backend, timeout_s=timeout)
    group: ProcessGroup
    if choice.process == TORCH:
        group = TorchDistributedGroup(choice.dist_backend)
    else:
        runtime = get_runtime(spec.device.kind)
        group = get_collective_backend(choice.process).process_group(
            spec.device, runtime, spec.rank, spec.world_size, timeout
        )
    control = dist.new_group(backend="gloo") if spec.multi_node else None
    worker = Worker(spec.device, group, config, model_config)
    worker.init_device(spec.cpu_threads)
    worker.load_model()
    num_blocks = worker.agree_num_blocks(worker.determine_num_blocks())
    worker.init_kv_cache(num_blocks)
    if results is not None:
        results.send(("ready", num_blocks))
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
        if step == STOP:
            break
        assert isinstance(step, ForwardInput)
        out = worker.execute_model(step)
        if spec.rank == 0 and results is not None:
            results.send(("out", out))
    if reader is not None:
        reader.close()
    dist.destroy_process_group()
