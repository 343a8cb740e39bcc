"""Single-process execution: one worker thread per local device, in the engine's process.

The step object itself goes to every worker and rank 0's output comes back as a Python
object: nothing on this path is serialized. The local ranks share one in-process
communicator set created for all of them at once; with several nodes, each node runs one such
process and node leaders meet over torch.distributed (two-level groups), node 0 sending each
step's input to the other nodes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch.distributed as dist

from tandem.collectives import ProcessGroup, SingleRankGroup, TwoLevelGroup
from tandem.core.config import EngineConfig
from tandem.core.errors import ConfigError, EngineDeadError
from tandem.core.executor.lanes import check_lanes_fit
from tandem.core.executor.rank_failure import step_failure
from tandem.core.executor.step_timeout import STEP_TIMEOUT_GRACE_S
from tandem.core.parallel.collective_choice import CollectiveChoice, resolve_collectives
from tandem.core.parallel.groups import (
    NO_COMMUNICATOR,
    Abortable,
    CommunicatorHandles,
    close_communicators,
    join_process_world,
    make_local_groups,
    make_process_group,
)
from tandem.core.parallel.topology import Topology
from tandem.core.worker.step_runner import MemoryFootprint, OutT, RunnerFactory, StepT
from tandem.core.worker.worker import Worker
from tandem.core.worker.worker_thread import WorkerThread
from tandem.device import DeviceRuntime, KernelRegistry, get_runtime
from tandem.device.sync import REAL_SYNC, Promise, Sync

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Builds the local ranks' groups and the handle that aborts them (the simulator's fake backend).
LocalGroupFactory = Callable[[int], tuple[list[ProcessGroup], Abortable]]

# What node 0 sends the other nodes instead of a step when it shuts down.
_STOP = "stop"


class ThreadExecutor(Generic[StepT, OutT]):
    def __init__(
        self,
        config: EngineConfig,
        runner_factory: RunnerFactory[StepT, OutT],
        topology: Topology,
        lanes: bool = False,
        sync: Sync = REAL_SYNC,
        local_groups: LocalGroupFactory | None = None,
        runtime: DeviceRuntime | None = None,
        kernel_registry: KernelRegistry[Any] | None = None,
    ):
        """``lanes``: give every worker ``max_concurrency`` pipeline lanes (``submit``)."""
        self.topology = topology
        self._sync = sync
        self._local_groups = local_groups
        self._closed = False
        self._timeout = config.parallel.timeout_s
        # Per pipeline lane, every rank's promise of the step it runs (for naming the ranks
        # of a step that times out).
        self._lane_steps: dict[int, list[Promise[Any]]] = {}
        # Per pipeline lane (lane 0 = the worker threads'), its communicator set.
        self._comms: list[CommunicatorHandles] = []
        # The node level of two-level groups (several nodes), beside lane 0's local set.
        self._inter_comms = NO_COMMUNICATOR
        self._runtime = runtime
        self._control: dist.ProcessGroup | None = None
        self.uses_lanes = lanes
        if lanes:
            check_lanes_fit(config, topology)
        groups = self._make_groups(config, topology)
        per_lane = self._make_lane_groups(config, topology, groups) if lanes else None
        self._workers = [
            Worker(
                device,
                group,
                config,
                runner_factory,
                runtime,
                kernel_registry,
                lane_groups=[s[rank] for s in per_lane] if per_lane else None,
                sync=sync,
            )
            for rank, (device, group) in enumerate(zip(topology.devices, groups, strict=True))
        ]
        self._threads = [WorkerThread(f"tandem-worker-{d}", sync) for d in topology.devices]
        try:
            threads = topology.cpu_threads_per_worker()
            self.on_all(lambda w: w.init_device(threads))
            self.on_all(lambda w: w.load_model())
            sizes = self.on_all(lambda w: w.determine_cache_size())
            agreed = self.on_all(lambda w: w.agree_cache_size(sizes[self._workers.index(w)]))
            self._cache_size = agreed[0]
            self.on_all(lambda w: w.init_kv_cache(self._cache_size))
            if lanes:
                self.on_all(lambda w: w.init_lanes())
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "single-process executor: %d worker threads on %s (node %d of %d)",
            len(self._workers),
            ",".join(str(d) for d in topology.devices),
            topology.node_rank,
            topology.nnodes,
        )

    def _make_groups(self, config: EngineConfig, topology: Topology) -> list[ProcessGroup]:
        """The local ranks' groups of lane 0 (the worker threads'), reaching across nodes."""
        if topology.world_size == 1:
            self._comms.append(NO_COMMUNICATOR)
            return [SingleRankGroup()]
        if self._local_groups is not None and topology.nnodes != 1:
            raise ConfigError("injected local groups serve one node only")
        choice = (
            None
            if self._local_groups is not None
            else resolve_collectives(
                config.parallel,
                topology.devices[0].kind,
                topology.uses_local_groups,
                topology.uses_process_groups,
            )
        )
        local, comms = self._local_set(config, topology, choice)
        self._comms.append(comms)
        if topology.nnodes == 1:
            return local
        assert choice is not None
        assert topology.master_node_addr is not None
        timeout = config.parallel.timeout_s
        join_process_world(
            topology.master_node_addr, topology.nnodes, topology.node_rank, choice, timeout
        )
        first = topology.devices[0]
        inter, self._inter_comms = make_process_group(
            choice, first, self._group_runtime(first.kind), topology.node_rank, topology.nnodes,
            timeout,
        )  # fmt: skip
        # A second group for node 0's step inputs, used only from the engine thread.
        self._control = dist.new_group(backend="gloo")
        return [
            TwoLevelGroup(g, inter if g.rank == 0 else None, topology.node_rank, topology.nnodes)
            for g in local
        ]

    def _local_set(
        self, config: EngineConfig, topology: Topology, choice: CollectiveChoice | None
    ) -> tuple[list[ProcessGroup], CommunicatorHandles]:
        """One communicator set for every local device, created at once (by the injected
        factory when there is one: the simulator's fake backend)."""
        if self._local_groups is not None:
            groups, abortable = self._local_groups(topology.local_size)
            return groups, CommunicatorHandles(abortable, None)
        assert choice is not None
        runtime = self._group_runtime(topology.devices[0].kind)
        return make_local_groups(
            choice, topology.devices, runtime, config.parallel.timeout_s, self._sync
        )

    def _make_lane_groups(
        self, config: EngineConfig, topology: Topology, lane0: list[ProcessGroup]
    ) -> list[list[ProcessGroup]]:
        """Per pipeline lane, per local rank: a communicator set for each lane, so that lanes'
        collectives never share (and interleave on) one communicator."""
        count = config.pipeline.max_concurrency
        if topology.world_size == 1:
            self._comms.extend(NO_COMMUNICATOR for _ in range(1, count))
            return [[SingleRankGroup()] for _ in range(count)]
        choice = (
            resolve_collectives(
                config.parallel, topology.devices[0].kind, uses_local=True, uses_process=False
            )
            if self._local_groups is None
            else None
        )
        sets = [lane0]
        for _ in range(1, count):
            groups, comms = self._local_set(config, topology, choice)
            sets.append(groups)
            self._comms.append(comms)
        return sets

    def _abort_lane(self, lane: int, reason: str) -> None:
        abortable = self._comms[lane].abortable if lane < len(self._comms) else None
        if abortable is not None:
            abortable.abort(reason)
        # Lane 0's leaders also run the node level of the two-level groups.
        if lane == 0 and self._inter_comms.abortable is not None:
            self._inter_comms.abortable.abort(reason)

    def _group_runtime(self, kind: str) -> DeviceRuntime:
        return self._runtime if self._runtime is not None else get_runtime(kind)

    def on_all(
        self, fn: Callable[[Worker[StepT, OutT]], T], timeout: float | None = None
    ) -> list[T]:
        """Run ``fn`` on every worker's thread at once; results in rank order. The first
        failure aborts the communicator, so ranks blocked in a collective with the failed
        one are released instead of waiting out the timeout; past ``timeout`` seconds the
        ranks still running are named and the communicator aborted too. With several ranks
        the error (EngineDeadError) names the rank that caused it."""
        settled = self._sync.condition()
        promises: list[Promise[T]] = []
        for thread, worker in zip(self._threads, self._workers, strict=True):
            promise = thread.submit(lambda w=worker: fn(w))  # type: ignore[misc]
            promises.append(promise)

        def on_done(_: Promise[T]) -> None:
            with settled:
                settled.notify_all()

        for promise in promises:
            promise.add_done_callback(on_done)
        deadline = None if timeout is None else self._sync.monotonic() + timeout
        late: list[int] = []
        gone: list[int] = []
        aborted = False
        with settled:
            while not all(p.done() for p in promises):
                failed = any(p.done() and p.exception() for p in promises)
                if failed and not aborted:
                    aborted = True
                    self._abort_lane(0, "another rank failed")
                if not all(t.is_alive() for t in self._threads):
                    gone = [r for r, t in enumerate(self._threads) if not t.is_alive()]
                    self._abort_lane(0, "a worker thread died")
                    break
                wait = 0.5
                if deadline is not None:
                    wait = min(wait, deadline - self._sync.monotonic())
                    if wait <= 0:
                        late = [r for r, p in enumerate(promises) if not p.done()]
                        self._abort_lane(0, "a step timed out")
                        break
                settled.wait(wait)
        errors = {r: e for r, p in enumerate(promises) if p.done() and (e := p.exception())}
        if not errors and not late and not gone:
            return [p.result() for p in promises]
        if timeout is None and self.topology.world_size == 1 and errors:
            # Loading on one device: the error itself (a model that cannot load, say).
            raise errors[0]
        first = next(iter(errors.values()), None)
        if isinstance(first, ConfigError) and not late and not gone:
            raise first
        raise step_failure(self._rank_names(), errors, late, timeout, gone) from first

    def _rank_names(self) -> list[tuple[int, str]]:
        """(global rank, device) of every local rank."""
        first = self.topology.first_rank
        return [(first + i, str(d)) for i, d in enumerate(self.topology.devices)]

    @property
    def workers(self) -> list[Worker[StepT, OutT]]:
        return list(self._workers)

    def call(self, rank: int, fn: Callable[[Worker[StepT, OutT]], T]) -> T:
        """Run ``fn`` on local rank ``rank``'s own thread."""
        thread, worker = self._threads[rank], self._workers[rank]
        return thread.wait(thread.submit(lambda: fn(worker)))

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
    def is_leader(self) -> bool:
        return self.topology.node_rank == 0

    @property
    def memory(self) -> MemoryFootprint:
        return self._workers[0].memory

    def execute(self, step: StepT) -> OutT:
        if self._control is not None:
            # Other nodes get the step over the network; local workers get the object itself.
            dist.broadcast_object_list([step], src=0, group=self._control)
        out = self.on_all(lambda w: w.execute(step), timeout=self._timeout + STEP_TIMEOUT_GRACE_S)[
            0
        ]
        if out is None:
            raise RuntimeError("rank 0 returned no output")
        return out

    def follow(self) -> None:
        """On nodes other than 0: run every step node 0 sends, until it stops."""
        assert self._control is not None and not self.is_leader
        while True:
            box: list[object] = [None]
            dist.broadcast_object_list(box, src=0, group=self._control)
            received = box[0]
            if isinstance(received, str) and received == _STOP:
                logger.info("node 0 stopped; leaving")
                return
            step: StepT = received  # type: ignore[assignment]
            self.on_all(lambda w, step=step: w.execute(step))  # type: ignore[misc]

    def submit(self, lane: int, step: StepT) -> Promise[OutT]:
        """Run ``step`` on pipeline lane ``lane`` of every worker; rank 0's output once every
        rank is done. Steps on different lanes run at once."""
        if not self.uses_lanes:
            raise ConfigError("this executor has no pipeline lanes (--max-concurrency 1)")
        combined: Promise[OutT] = Promise(self._sync)
        ranks = [w.submit(lane, step) for w in self._workers]
        self._lane_steps[lane] = list(ranks)
        lock = self._sync.lock()
        remaining = [len(ranks)]

        def on_done(done: Promise[OutT | None]) -> None:
            if done.exception() is not None:
                # Ranks of this lane blocked in a collective with the failed one get released.
                self._abort_lane(lane, "another rank failed")
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if not last:
                return
            errors = {r: e for r, p in enumerate(ranks) if (e := p.exception()) is not None}
            out = ranks[0].result() if not errors else None
            if not errors and out is None:
                errors[0] = RuntimeError("rank 0 returned no output")
            if not errors:
                assert out is not None
                combined.set_result(out)
            elif len(ranks) > 1:
                combined.set_exception(step_failure(self._rank_names(), errors, [], None))
            else:
                combined.set_exception(errors[0])

        for promise in ranks:
            promise.add_done_callback(on_done)
        return combined

    def timed_out(self, lane: int, timeout: float) -> EngineDeadError:
        """The step on ``lane`` ran past ``timeout``: release its ranks (abort the lane's
        communicator) and name the ones still running."""
        ranks = self._lane_steps.get(lane, [])
        late = [r for r, p in enumerate(ranks) if not p.done()]
        errors = {r: e for r, p in enumerate(ranks) if p.done() and (e := p.exception())}
        self._abort_lane(lane, "a step timed out")
        return step_failure(self._rank_names(), errors, late, timeout)

    def check_health(self) -> None:
        if self._closed or not all(t.is_alive() for t in self._threads):
            raise EngineDeadError("a worker thread is not running")
        if not all(lane.is_alive() for w in self._workers for lane in w.lanes):
            raise EngineDeadError("a pipeline lane's thread is not running")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._control is not None and self.is_leader:
            try:
                dist.broadcast_object_list([_STOP], src=0, group=self._control)
            except RuntimeError:
                logger.warning("could not tell the other nodes to stop")
        every = [*self._comms, self._inter_comms]
        for comms in every:
            if comms.closeable is None and comms.abortable is not None:
                comms.abortable.abort("the executor is shutting down")
        for worker in self._workers:
            worker.stop_lanes()
        for thread in self._threads:
            thread.stop()
        if self._control is not None and dist.is_initialized():
            # Tear the node groups down before the interpreter does: gloo's threads still
            # running at exit abort the process ("terminate called without an active
            # exception").
            try:
                dist.destroy_process_group()
            except RuntimeError:
                logger.warning("could not destroy the node groups cleanly")
        idle = not any(t.is_alive() for t in self._threads) and not any(
            lane.is_alive() for w in self._workers for lane in w.lanes
        )
        if idle:
            close_communicators(every, "the executor is shutting down")
            return
        for comms in every:
            if comms.closeable is not None:
                # A thread still inside a collective: release it, never free under it.
                comms.closeable.abort("the executor is shutting down")
