"""The executor interface between the engine and its workers, and the by-name factory."""

from __future__ import annotations

from typing import Protocol

from tandem.core.config import EngineConfig
from tandem.core.llm.forward_input import ForwardInput, SamplerOutput
from tandem.core.rec.step import RecStep, RecStepOutput
from tandem.core.worker.worker import AnyModelConfig
from tandem.device.sync import Promise


class Executor(Protocol):
    @property
    def num_blocks(self) -> int:
        """KV blocks every worker has room for (the smallest over workers)."""
        ...

    def execute_model(self, fi: ForwardInput) -> SamplerOutput:
        """Run one step on every worker; rank 0's sampled tokens."""
        ...

    def submit_model(self, lane: int, fi: ForwardInput) -> Promise[SamplerOutput]:
        """Run one step on pipeline lane ``lane`` of every worker, without waiting."""
        ...

    def submit_rec(self, lane: int, step: RecStep) -> Promise[RecStepOutput]:
        """Run one recommendation step on pipeline lane ``lane``, without waiting."""
        ...

    def follow(self) -> None:
        """On a node other than 0: serve node 0's steps until it stops."""
        ...

    def check_health(self) -> None:
        """Raise EngineDeadError if a worker is gone."""
        ...

    def shutdown(self) -> None: ...


def create_executor(config: EngineConfig, model_config: AnyModelConfig) -> Executor:
    """The executor the topology calls for; layouts that cannot work fail here, before any
    worker starts."""
    from tandem.core.parallel.topology import Mode, resolve_topology

    topology = resolve_topology(config.parallel)
    if topology.mode is Mode.SINGLE_PROCESS:
        from tandem.core.executor.thread_executor import ThreadExecutor

        return ThreadExecutor(config, model_config, topology)
    from tandem.core.executor.process_executor import ProcessExecutor

    return ProcessExecutor(config, model_config, topology)
