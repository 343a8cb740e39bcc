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
import signal
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Generic

from tandem.core.config import EngineConfig
from tandem.core.errors import ConfigError, EngineDeadError, EngineUnhealthyError
from tandem.core.executor.step_timeout import STEP_TIMEOUT_GRACE_S
from tandem.core.executor.transport import ShmBroadcastWriter
from tandem.core.executor.worker_process import STOP, WorkerFailure, WorkerSpec, worker_main
from tandem.core.kv.cache_sizing import CacheSize
from tandem.core.parallel.collective_choice import resolve_collectives
from tandem.core.parallel.groups import STARTUP_TIMEOUT_S
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
        # Set once a step failed: the workers are stopped and this says why.
        self._dead: str | None = None
        ctx = mp.get_context("spawn")
        self._writer = ShmBroadcastWriter(SHM_CAPACITY)
        self._procs: list[BaseProcess] = []
        self._notes: list[Connection] = []
        self._results: list[Connection] = []
        multi_node = topology.nnodes > 1
        self._multi_node = multi_node
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
            startup = max(self._timeout, STARTUP_TIMEOUT_S)
            ready = [self._receive(i, "ready", startup) for i in range(len(self._procs))]
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

    def _rank_name(self, index: int) -> str:
        return f"rank {self.topology.first_rank + index} ({self.topology.devices[index]})"

    def _exit_text(self, index: int) -> str:
        code = self._procs[index].exitcode
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                return f"its worker process was killed by {signal.Signals(-code).name}"
        return f"its worker process exited with code {code}"

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        exited = [i for i, p in enumerate(self._procs) if p.exitcode is not None]
        # Killed by a signal first: a rank that exits 1 after a failed collective is a victim.
        exited.sort(key=lambda i: (self._procs[i].exitcode or 0) >= 0)
        if exited:
            raise EngineDeadError(f"{self._rank_name(exited[0])}: {self._exit_text(exited[0])}")

    def _receive(self, index: int, kind: str, timeout: float) -> Any:
        """One message of ``kind`` from local rank ``index`` (start-up)."""
        conn = self._results[index]
        deadline = time.monotonic() + timeout
        while not conn.poll(_POLL_S):
            self._check_alive()
            if time.monotonic() > deadline:
                raise EngineDeadError(
                    f"{self._rank_name(index)} gave no {kind!r} within {timeout:.0f} s"
                )
        try:
            tag, value = conn.recv()
        except (EOFError, OSError):
            self._check_alive()
            raise EngineDeadError(f"{self._rank_name(index)} closed its pipe") from None
        if tag == "error":
            raise EngineDeadError(rank_failure_text(self._rank_name(index), value.cause))
        if tag != kind:
            raise EngineDeadError(f"{self._rank_name(index)} sent {tag!r}, expected {kind!r}")
        return value

    def _collect(self, targets: list[int]) -> Any:
        """Rank 0's output once every rank in ``targets`` answered the step; otherwise (a
        rank failed, died or did not answer within the timeout) every worker is stopped and
        the error names the rank that caused it."""
        # The ranks' own collectives time out at the step timeout: waiting a little longer
        # lets them report first, so a rank that never arrived is told from those it held up.
        deadline = time.monotonic() + self._timeout + STEP_TIMEOUT_GRACE_S
        waiting = set(targets)
        out: Any = None
        failures: dict[int, WorkerFailure] = {}
        exited: set[int] = set()
        settle_by: float | None = None
        while waiting:
            by_conn = {id(self._results[i]): i for i in waiting}
            for ready in wait([self._results[i] for i in waiting], timeout=_POLL_S):
                index = by_conn[id(ready)]
                waiting.discard(index)
                try:
                    tag, value = self._results[index].recv()
                except (EOFError, OSError):
                    exited.add(index)
                    continue
                if tag == "out":
                    out = value
                elif tag == "error":
                    failures[index] = value
            for index, proc in enumerate(self._procs):
                if proc.exitcode is None or index in failures:
                    continue
                if index in waiting and self._results[index].poll():
                    continue  # its last words are read next
                exited.add(index)
                waiting.discard(index)
            now = time.monotonic()
            if failures or exited:
                # A moment for the other ranks' reports: the earliest failure is the cause.
                settle_by = settle_by or now + 1.0
                if now >= settle_by:
                    break
            if now >= deadline:
                break
        if not failures and not exited and not waiting:
            return out
        raise self._die(failures, exited, sorted(waiting), timed_out=not (failures or exited))

    def _die(
        self,
        failures: dict[int, WorkerFailure],
        exited: set[int],
        late: list[int],
        timed_out: bool,
    ) -> EngineDeadError:
        # The cause first: a rank's own failure or death, then ranks that never finished,
        # and only then the failures they caused elsewhere (aborted, timed out).
        by_time = sorted(failures.items(), key=lambda item: item[1].at)
        own = [(i, f) for i, f in by_time if not f.consequence]
        caused = [(i, f) for i, f in by_time if f.consequence]
        parts = [rank_failure_text(self._rank_name(i), f.cause) for i, f in own]
        parts += [
            f"{self._rank_name(i)}: {self._exit_text(i)}"
            for i in sorted(exited, key=lambda i: (self._procs[i].exitcode or 0) >= 0)
        ]
        for index in late:
            if timed_out:
                parts.append(
                    f"{self._rank_name(index)} did not finish the step within {self._timeout:g} s"
                )
            else:
                parts.append(f"{self._rank_name(index)} did not finish the step")
        parts += [rank_failure_text(self._rank_name(i), f.cause) for i, f in caused]
        message = "; ".join(parts[:3])
        logger.error("a step failed: %s", message)
        self._dead = message
        # No rank may wait for the failed one in a collective: stop them all.
        self._stop_workers(grace_s=0.0)
        return EngineDeadError(message)

    def _stop_workers(self, grace_s: float) -> None:
        for proc in self._procs:
            proc.join(grace_s)
            if proc.is_alive():
                proc.terminate()
        for proc in self._procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)

    @property
    def num_blocks(self) -> int:
        return self._cache_size.num_blocks

    @property
    def num_state_slots(self) -> int:
        return self._cache_size.num_state_slots

    @property
    def num_state_snapshots(self) -> int:
        return self._cache_size.num_state_snapshots

    @property
    def memory(self) -> MemoryFootprint:
        return self._memory

    def execute(self, step: StepT) -> OutT:
        if self._closed:
            raise EngineDeadError("the executor is shut down")
        self._check_alive()
        seq, length = self._writer.write(pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL))
        # With several nodes, rank 0 forwards the step to every other rank itself.
        targets = [0] if self._multi_node else list(range(len(self._procs)))
        for index in targets:
            try:
                self._notes[index].send(("step", seq, length))
            except OSError:
                raise self._die({}, {index}, [], timed_out=False) from None
        out: OutT = self._collect(targets)
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
        for index, proc in enumerate(self._procs):
            if proc.pid is not None and _is_stopped(proc.pid):
                raise EngineUnhealthyError(
                    f"{self._rank_name(index)}: its worker process is stopped (SIGSTOP?)"
                )

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in self._notes:
            with contextlib.suppress(OSError):
                conn.send((STOP, 0, 0))
        self._stop_workers(grace_s=5.0)
        self._writer.close()


def rank_failure_text(rank: str, cause: str) -> str:
    return f"{rank} failed: {cause}"


def _is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (state T in /proc; False where there is none)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            # "pid (comm) state ...": comm may hold spaces, the state follows its ")".
            return stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False
