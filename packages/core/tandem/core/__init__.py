"""Tandem's engine core: configuration, models, KV cache, scheduler, workers and engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.device.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from tandem.core.config import CacheConfig, EngineConfig, ModelLoadConfig, SchedulerConfig
    from tandem.core.errors import (
        ConfigError,
        EngineDeadError,
        InvalidRequestError,
        ModelLoadError,
        TandemError,
    )
    from tandem.core.llm.engine import LLMEngine
    from tandem.core.llm.engine_loop import AsyncEngine, EngineLoop
    from tandem.core.llm.outputs import RequestOutput
    from tandem.core.llm.sampling_params import SamplingParams

# Each public name and the module that defines it, imported on first use so that importing
# one submodule does not load the others (see tandem.device.lazy_exports).
_EXPORTS = {
    "AsyncEngine": "tandem.core.llm.engine_loop",
    "CacheConfig": "tandem.core.config",
    "ConfigError": "tandem.core.errors",
    "EngineConfig": "tandem.core.config",
    "EngineDeadError": "tandem.core.errors",
    "EngineLoop": "tandem.core.llm.engine_loop",
    "InvalidRequestError": "tandem.core.errors",
    "LLMEngine": "tandem.core.llm.engine",
    "ModelLoadConfig": "tandem.core.config",
    "ModelLoadError": "tandem.core.errors",
    "RequestOutput": "tandem.core.llm.outputs",
    "SamplingParams": "tandem.core.llm.sampling_params",
    "SchedulerConfig": "tandem.core.config",
    "TandemError": "tandem.core.errors",
}

__all__ = [
    "AsyncEngine",
    "CacheConfig",
    "ConfigError",
    "EngineConfig",
    "EngineDeadError",
    "EngineLoop",
    "InvalidRequestError",
    "LLMEngine",
    "ModelLoadConfig",
    "ModelLoadError",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "TandemError",
]

if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
