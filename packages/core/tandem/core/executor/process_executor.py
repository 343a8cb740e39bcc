"""Multi-process execution: one process per device, joined through torch.distributed.

The engine spawns this node's worker processes. Each step's input is pickled once, written
once into shared memory, and announced to every local worker on its own pipe; with several
nodes, rank 0 forwards it to every rank over torch.distributed. Only rank 0 answers. A worker
process that dies is noticed within a second and the engine is told, instead of waiting.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import pickle
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Generic

from tandem.core.config import EngineConfig
from tandem.core.errors import ConfigError, EngineDeadError
from tandem.core.executor.transport import ShmBroadcastWriter
from tandem.core.executor.worker_process import STOP, WorkerSpec, worker_main
from tandem.core.kv.cache_sizing import CacheSize
from tandem.core.parallel.collective_choice import resolve_collectives
from tandem.core.parallel.topology import Topology
from tandem.core.worker.step_runner import MemoryFootprint, OutT, RunnerFactory, StepT

logger = logging.getLogger(__name__)

SHM_CAPACITY = 64 << 20
_POLL_S = 0.2


class ProcessExecutor(Generic[StepT, OutT]):
    def __init__(
        self,
        config: EngineConfig,
        runner_factory: RunnerFactory[StepT, OutT],
        topology: Topology,
    ):
        if topology.master_node_addr is None:
            raise ConfigError("multi-process mode needs --master-node-addr HOST:PORT")
        # Before any process starts: the collectives exist and serve this device kind.
        resolve_collectives(
            config.parallel,
            topology.devices[0].kind,
            uses_local=False,
            uses_process=topology.uses_process_groups,
        )
        self.topology = topology
        self._timeout = config.parallel.timeout_s
        self._closed = False
        ctx = mp.get_context("spawn")
        self._writer = ShmBroadcastWriter(SHM_CAPACITY)
        self._procs: list[BaseProcess] = []
        self._notes: list[Connection] = []
        self._results: list[Connection] = []
        multi_node = topology.nnodes > 1
        try:
            for i, device in enumerate(topology.devices):
                rank = topology.first_rank + i
                notes_r, notes_w = ctx.Pipe(duplex=False)
                results_r, results_w = ctx.Pipe(duplex=False)
                spec = WorkerSpec(
                    rank=rank,
                    world_size=topology.world_size,
                    device=device,
                    cpu_threads=topology.cpu_threads_per_worker(),
                    master_node_addr=topology.master_node_addr,
                    shm_name=self._writer.name,
                    multi_node=multi_node,
                )
                proc = ctx.Process(
                    target=worker_main,
                    args=(spec, config, runner_factory, notes_r, results_w),
                    name=f"tandem-worker-rank{rank}",
                    daemon=True,
                )
                proc.start()
                self._procs.append(proc)
                self._notes.append(notes_w)
                self._results.append(results_r)
            ready = [self._receive(i, "ready", self._timeout) for i in range(len(self._procs))]
        except BaseException:
            self.shutdown()
            raise
        size, memory = ready[0]
        self._cache_size: CacheSize = size
        self._memory: MemoryFootprint = memory
        logger.info(
            "multi-process executor: ranks %d..%d of %d on %s",
            topology.first_rank,
            topology.first_rank + topology.local_size - 1,
            topology.world_size,
            ",".join(str(d) for d in topology.devices),
        )

    def _check_alive(self) -> None:
        self._check_alive_with_cause(None)

    def _check_alive_with_cause(self, seen: str | None) -> None:
        exited = [p for p in self._procs if p.exitcode is not None]
        # Killed by a signal first: a rank that exits 1 after a failed collective is a victim.
        for proc in sorted(exited, key=lambda p: (p.exitcode or 0) >= 0):
            if proc.exitcode is not None:
                message = f"worker process {proc.name} exited with code {proc.exitcode}"
                raise EngineDeadError(message if seen is None else f"{message} ({seen})")

    def _receive(self, index: int, kind: str, timeout: float) -> Any:
        conn = self._results[index]
        deadline = time.monotonic() + timeout
        while not conn.poll(_POLL_S):
            self._check_alive()
            if time.monotonic() > deadline:
                raise EngineDeadError(
                    f"worker {self._procs[index].name} gave no {kind!r} within {timeout:.0f} s"
                )
        try:
            tag, value = conn.recv()
        except (EOFError, OSError):
            self._check_alive()
            raise EngineDeadError(f"worker {self._procs[index].name} closed its pipe") from None
        if tag == "error":
            # A rank's collective usually fails because a peer died: name the dead one.
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                self._check_alive_with_cause(str(value).splitlines()[0])
                time.sleep(0.05)
            raise EngineDeadError(f"worker failed: {value}")
        if tag != kind:
            raise EngineDeadError(f"worker sent {tag!r}, expected {kind!r}")
        return value

    @property
    def num_blocks(self) -> int:
        return self._cache_size.num_blocks

    @property
    def num_state_slots(self) -> int:
        return self._cache_size.num_state_slots

    @property
    def memory(self) -> MemoryFootprint:
        return self._memory

    def execute(self, step: StepT) -> OutT:
        if self._closed:
            raise EngineDeadError("the executor is shut down")
        self._check_alive()
        seq, length = self._writer.write(pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL))
        try:
            for conn in self._notes:
                conn.send(("step", seq, length))
        except OSError:
            self._check_alive()
            raise
        out: OutT = self._receive(0, "out", self._timeout)
        return out

    def follow(self) -> None:
        """On nodes other than 0: keep the local workers until they leave."""
        while any(p.is_alive() for p in self._procs):
            for proc in self._procs:
                proc.join(_POLL_S)
            for proc in self._procs:
                if proc.exitcode not in (None, 0):
                    raise EngineDeadError(f"worker {proc.name} exited with {proc.exitcode}")

    def check_health(self) -> None:
        if self._closed:
            raise EngineDeadError("the executor is shut down")
        self._check_alive()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in self._notes:
            with contextlib.suppress(OSError):
                conn.send((STOP, 0, 0))
        for proc in self._procs:
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
        self._writer.close()
