"""The executor interface between the engine and its workers, and the by-name factory."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from tandem.core.config import EngineConfig
from tandem.core.errors import ConfigError
from tandem.core.forward_input import ForwardInput, SamplerOutput
from tandem.core.models.model_config import ModelConfig


class Executor(Protocol):
    @property
    def num_blocks(self) -> int:
        """KV blocks every worker has room for (the smallest over workers)."""
        ...

    def execute_model(self, fi: ForwardInput) -> SamplerOutput:
        """Run one step on every worker; rank 0's sampled tokens."""
        ...

    def check_health(self) -> None:
        """Raise EngineDeadError if a worker is gone."""
        ...

    def shutdown(self) -> None: ...


ExecutorFactory = Callable[[EngineConfig, ModelConfig], Executor]


def create_executor(config: EngineConfig, model_config: ModelConfig) -> Executor:
    from tandem.core.thread_executor import ThreadExecutor

    factories: dict[str, ExecutorFactory] = {"thread": ThreadExecutor}
    factory = factories.get(config.executor)
    if factory is None:
        raise ConfigError(
            f"unknown executor {config.executor!r}; choose one of {', '.join(sorted(factories))}"
        )
    return factory(config, model_config)
