"""Shared fixtures: tiny models written in the Hugging Face layout, and engines over them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from reference_models import write_reference_model

from tandem.core import CacheConfig, EngineConfig, LLMEngine, ModelLoadConfig, SchedulerConfig
from tandem.core.config import ParallelConfig, PipelineConfig, SpeculativeConfig
from tandem.core.demo.demo_model import tiny_spec, write_demo_model
from tandem.core.llm.forward_input import ForwardInput, SamplerOutput
from tandem.core.llm.model_runner import ModelRunner
from tandem.core.llm.prompt_logits import prompt_logits as prompt_logits
from tandem.core.worker.worker import Worker


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Qwen3-architecture demo model with its trained byte-level BPE tokenizer."""
    return write_demo_model(tmp_path_factory.mktemp("demo"), tiny_spec())


@pytest.fixture(scope="session")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3.5 hybrid (a Gated DeltaNet layer, then a gated full-attention layer) with
    the demo tokenizer: the engine gives each of its sequences a state slot."""
    folder = tmp_path_factory.mktemp("hybrid")
    write_reference_model(folder, "Qwen3_5ForCausalLM")
    return folder


HfFactory = Callable[..., tuple[Path, Any]]


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> HfFactory:
    """Build a random transformers model, save it (safetensors) with the demo tokenizer."""

    def build(
        architecture: str, max_shard_size: str | None = None, **overrides: Any
    ) -> tuple[Path, Any]:
        folder = tmp_path_factory.mktemp(architecture)
        model = write_reference_model(folder, architecture, max_shard_size, **overrides)
        return folder, model

    return build


def assert_all_returned(engine: LLMEngine) -> None:
    """At rest: every state slot free, and every KV block free but those that the prefix
    cache's state snapshots hold (hybrid models), which go back when the snapshots do."""
    stats = engine.stats
    assert stats.num_free_state_slots == stats.num_state_slots
    assert stats.num_free_blocks + stats.num_snapshot_blocks == stats.num_blocks, stats
    snapshots = engine.scheduler.snapshots
    if snapshots is not None:
        assert snapshots.num_pinned == 0
        snapshots.clear()
        assert snapshots.num_snapshots == 0
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def engine_config(
    model: Path,
    *,
    num_blocks: int | None = 256,
    num_state_slots: int | None = None,
    cpu_memory_gb: float = 4.0,
    block_size: int = 16,
    enable_prefix_cache: bool = True,
    state_cache_mb: float | None = None,
    state_snapshot_interval: int = 512,
    enable_chunked_prefill: bool = True,
    max_tokens_per_batch: int = 2048,
    max_seqs_per_batch: int = 64,
    stall_timeout_s: float = 60.0,
    dtype: str = "auto",
    max_model_len: int | None = None,
    parallel: ParallelConfig | None = None,
    pipeline: PipelineConfig | None = None,
    speculative: SpeculativeConfig | None = None,
) -> EngineConfig:
    return EngineConfig(
        model=ModelLoadConfig(model=str(model), dtype=dtype, max_model_len=max_model_len),
        cache=CacheConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            num_state_slots=num_state_slots,
            cpu_memory_gb=cpu_memory_gb,
            enable_prefix_cache=enable_prefix_cache,
            state_cache_mb=state_cache_mb,
            state_snapshot_interval=state_snapshot_interval,
        ),
        scheduler=SchedulerConfig(
            max_tokens_per_batch=max_tokens_per_batch,
            max_seqs_per_batch=max_seqs_per_batch,
            enable_chunked_prefill=enable_chunked_prefill,
            stall_timeout_s=stall_timeout_s,
        ),
        parallel=parallel or ParallelConfig(),
        pipeline=pipeline or PipelineConfig(),
        speculative=speculative,
    )


EngineFactory = Callable[..., LLMEngine]


@pytest.fixture
def make_engine() -> Iterator[EngineFactory]:
    """Engines built by a test are shut down after it."""
    engines: list[LLMEngine] = []

    def build(model: Path, **kwargs: Any) -> LLMEngine:
        engine = LLMEngine(engine_config(model, **kwargs))
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        engine.shutdown()


@pytest.fixture(scope="session")
def config_for() -> Callable[..., EngineConfig]:
    """``engine_config`` for fixtures that build their own long-lived engines."""
    return engine_config


def model_runner(worker: Worker[ForwardInput, SamplerOutput]) -> ModelRunner:
    """An LLM worker's runner, as the type the tests poke at."""
    runner = worker.runner
    assert isinstance(runner, ModelRunner)
    return runner


class HeldTensor:
    """A checkpoint tensor as safetensors' slices present it (``LazyTensor``), held in memory."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: object) -> torch.Tensor:
        return self.tensor[index]  # type: ignore[index]
