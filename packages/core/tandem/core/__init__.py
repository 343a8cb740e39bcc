"""Tandem's engine core: configuration, models, KV cache, scheduler, workers and engine."""

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
