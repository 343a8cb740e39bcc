"""The executor interface between a product's engine and the workers, and the factories that
pick an implementation by topology. Executors move opaque steps: a product makes its steps,
the runner factory it passes in knows how to run them."""

from __future__ import annotations

from typing import Protocol, TypeVar

from tandem.core.config import EngineConfig
from tandem.core.errors import EngineDeadError
from tandem.core.executor.lanes import check_lanes_fit
from tandem.core.executor.process_executor import ProcessExecutor
from tandem.core.executor.thread_executor import ThreadExecutor
from tandem.core.parallel.topology import Mode, resolve_topology
from tandem.core.worker.step_runner import MemoryFootprint, OutT, RunnerFactory, StepT
from tandem.device.sync import Promise

StepT_contra = TypeVar("StepT_contra", contravariant=True)
OutT_co = TypeVar("OutT_co", covariant=True)


class Executor(Protocol[StepT_contra, OutT_co]):
    @property
    def num_blocks(self) -> int:
        """KV blocks every worker has room for (the smallest over workers)."""
        ...

    @property
    def num_state_slots(self) -> int:
        """Linear-attention state slots every worker has (0: the model keeps no state)."""
        ...

    @property
    def num_state_snapshots(self) -> int:
        """State pool rows after the slots that every worker keeps for prefix-cache snapshots
        (kv/state_snapshots.py; 0: none)."""
        ...

    @property
    def memory(self) -> MemoryFootprint:
        """What rank 0's weights and KV cache take."""
        ...

    def execute(self, step: StepT_contra) -> OutT_co:
        """Run one step on every worker; rank 0's output."""
        ...

    def follow(self) -> None:
        """On a node other than 0: serve node 0's steps until it stops."""
        ...

    def check_health(self) -> None:
        """Raise EngineDeadError if a worker is gone."""
        ...

    def shutdown(self) -> None: ...


class LaneExecutor(Executor[StepT_contra, OutT], Protocol[StepT_contra, OutT]):
    """An executor whose workers have pipeline lanes: several steps in flight at once."""

    def submit(self, lane: int, step: StepT_contra) -> Promise[OutT]:
        """Run one step on pipeline lane ``lane`` of every worker, without waiting."""
        ...

    def timed_out(self, lane: int, timeout: float) -> EngineDeadError:
        """The step on ``lane`` ran past ``timeout``: release its ranks and say which ones
        were still running."""
        ...


def create_executor(
    config: EngineConfig, runner_factory: RunnerFactory[StepT, OutT]
) -> Executor[StepT, OutT]:
    """The executor the topology calls for; layouts that cannot work fail here, before any
    worker starts."""
    topology = resolve_topology(config.parallel)
    if topology.mode is Mode.SINGLE_PROCESS:
        return ThreadExecutor(config, runner_factory, topology)
    return ProcessExecutor(config, runner_factory, topology)


def create_lane_executor(
    config: EngineConfig, runner_factory: RunnerFactory[StepT, OutT]
) -> LaneExecutor[StepT, OutT]:
    """An executor with ``--max-concurrency`` pipeline lanes per worker. Lanes are threads of
    the process that drives the devices, so only single-process mode on one node has them."""
    topology = resolve_topology(config.parallel)
    check_lanes_fit(config, topology)  # before anything loads
    return ThreadExecutor(config, runner_factory, topology, lanes=True)
