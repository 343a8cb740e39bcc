"""Greedy tokens do not depend on what else is in the batch, on chunked prefill, on prefix
caching, or on being preempted and recomputed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tandem.core import EngineConfig, LLMEngine, SamplingParams

PREFIX = "The scheduler reads the prompt in order, and every device binds its stream. "
PROMPTS = [
    "hello world",
    PREFIX + "Question: what is 12 + 30?",
    "Tandem serves the KV cache on the CPU " * 6,
    PREFIX + "The model answers quickly.",
    "λ",
]
MAX_TOKENS = 24


def _greedy(engine: LLMEngine, prompts: list[str]) -> list[list[int]]:
    params = SamplingParams.greedy(max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = engine.generate(prompts, params)
    assert all(o.finish_reason == "length" for o in outs)
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def alone(demo_dir: Path, config_for: Callable[..., EngineConfig]) -> list[list[int]]:
    """Each prompt run by itself, no chunking, no prefix cache: the reference."""
    engine = LLMEngine(
        config_for(demo_dir, enable_prefix_cache=False, enable_chunked_prefill=False)
    )
    try:
        return [_greedy(engine, [p])[0] for p in PROMPTS]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("prefix_cache", [False, True])
def test_batch_matches_alone(
    demo_dir: Path,
    make_engine: Callable[..., LLMEngine],
    alone: list[list[int]],
    chunked: bool,
    prefix_cache: bool,
) -> None:
    engine = make_engine(
        demo_dir,
        enable_prefix_cache=prefix_cache,
        enable_chunked_prefill=chunked,
        # Small budget: prompts are split into chunks and share steps with decodes.
        max_tokens_per_batch=24 if chunked else 256,
        block_size=4,
    )
    assert _greedy(engine, PROMPTS) == alone
    # A second round hits the prefix cache (when on) for every prompt.
    assert _greedy(engine, list(reversed(PROMPTS))) == list(reversed(alone))
    if prefix_cache:
        hits = engine.generate([PROMPTS[1]], SamplingParams.greedy(max_tokens=1))[0]
        assert hits.num_cached_tokens > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_preemption_recomputes_to_the_same_tokens(
    demo_dir: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    prompts = ["hello world", "λ", "the model", "a block of text", "one thread", "Ω 42"]
    roomy = make_engine(demo_dir, block_size=4, enable_prefix_cache=False)
    expected = [_greedy(roomy, [p])[0] for p in prompts]
    # 14 blocks of 4 tokens: every request fits alone, and all are admitted (one block each),
    # but they cannot all grow to their 24 new tokens together.
    tight = make_engine(demo_dir, num_blocks=14, block_size=4, enable_prefix_cache=False)
    assert _greedy(tight, prompts) == expected
    assert tight.scheduler.num_preemptions > 0
    assert tight.block_manager.num_free_blocks == tight.block_manager.num_blocks
