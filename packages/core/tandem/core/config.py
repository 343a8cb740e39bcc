"""Typed configuration for every part of the engine; flags map onto these dataclasses once."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.core.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Explicit block count; None sizes the cache from the memory budget.
    num_blocks: int | None = None
    max_memory_utilization: float = 0.9
    # RAM budget in GiB that CPU "devices" may use for weights plus KV cache.
    cpu_memory_gb: float = 4.0
    enable_prefix_cache: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ConfigError(f"--block-size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"--num-blocks must be >= 1, got {self.num_blocks}")
        if not 0.0 < self.max_memory_utilization <= 1.0:
            raise ConfigError(
                f"--max-memory-utilization must be in (0, 1], got {self.max_memory_utilization}"
            )
        if self.cpu_memory_gb <= 0:
            raise ConfigError(f"--cpu-memory-gb must be > 0, got {self.cpu_memory_gb}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_tokens_per_batch: int = 2048
    max_seqs_per_batch: int = 64
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens_per_batch < 1:
            raise ConfigError(
                f"--max-tokens-per-batch must be >= 1, got {self.max_tokens_per_batch}"
            )
        if self.max_seqs_per_batch < 1:
            raise ConfigError(f"--max-seqs-per-batch must be >= 1, got {self.max_seqs_per_batch}")


@dataclass(frozen=True)
class ModelLoadConfig:
    model: str
    # "auto": the checkpoint's dtype, except half precision on CPU (which runs in float32).
    dtype: str = "auto"
    # Cap on the context length; None takes the model's max_position_embeddings.
    max_model_len: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"--max-model-len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelLoadConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "cpu:0"
    # How workers are run, by name: "thread" = worker threads in this process.
    executor: str = "thread"
