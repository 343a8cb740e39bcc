"""Prompt logprobs equal transformers' log-softmax over the prompt, whether the prompt is
computed in one step or in chunks, and whether or not its prefix is already cached."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers

from tandem.core import LLMEngine, SamplingParams
from tandem.core.demo.pretrained import stories260k_folder

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play outside."


@pytest.fixture(scope="module")
def expected() -> tuple[list[int], torch.Tensor]:
    folder = stories260k_folder()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    ids = transformers.AutoTokenizer.from_pretrained(str(folder))(PROMPT).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return ids, logits.log_softmax(-1)


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {},
        # Chunks of 8 tokens across several steps; the prefix cache holds the prompt already.
        {"max_tokens_per_batch": 8, "block_size": 4},
    ],
)
def test_prompt_logprobs_equal_transformers(
    make_engine: Callable[..., LLMEngine],
    expected: tuple[list[int], torch.Tensor],
    engine_kwargs: dict[str, Any],
) -> None:
    ids, reference = expected
    engine = make_engine(stories260k_folder(), **engine_kwargs)
    # Warm the prefix cache: cached blocks must not cost prompt positions their logprobs.
    engine.generate([PROMPT], SamplingParams.greedy(max_tokens=2))
    [out] = engine.generate([PROMPT], SamplingParams.greedy(max_tokens=2, prompt_logprobs=3))
    scored = out.prompt_logprobs
    assert scored is not None and out.prompt_token_ids == ids
    assert len(scored) == len(ids) and scored[0] is None
    worst = 0.0
    for position in range(1, len(ids)):
        entry = scored[position]
        assert entry is not None and entry.token_id == ids[position]
        row = reference[position - 1]
        worst = max(worst, abs(entry.logprob - row[ids[position]].item()))
        assert entry.rank == int((row > row[ids[position]]).sum()) + 1
        top_ids = [t for t, _ in entry.top]
        assert top_ids == row.topk(3).indices.tolist()
        for token, value in entry.top:
            assert math.isclose(value, row[token].item(), abs_tol=1e-4)
    assert worst < 1e-4, worst
    assert out.num_cached_tokens == 0


def test_preemption_does_not_score_twice(make_engine: Callable[..., LLMEngine]) -> None:
    prompts = [PROMPT, "The cat sat on the mat and", "One day, a boy", "Tom and Sue went"]
    params = SamplingParams.greedy(max_tokens=24, prompt_logprobs=1, ignore_eos=True)
    roomy = make_engine(stories260k_folder(), block_size=4)
    expected = roomy.generate(prompts, params)
    tight = make_engine(stories260k_folder(), num_blocks=16, block_size=4)
    got = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    for want, have in zip(expected, got, strict=True):
        assert have.prompt_logprobs is not None and want.prompt_logprobs is not None
        assert len(have.prompt_logprobs) == len(have.prompt_token_ids)
        assert [e.token_id if e else None for e in have.prompt_logprobs] == [
            e.token_id if e else None for e in want.prompt_logprobs
        ]
        assert have.token_ids == want.token_ids


def test_a_one_token_prompt_has_one_entry(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine(stories260k_folder())
    [out] = engine.generate([[1]], SamplingParams.greedy(max_tokens=2, prompt_logprobs=1))
    assert out.prompt_logprobs == [None]
    # Fully scored from the start: the prefix cache may serve it like any other prompt.
    seq = engine.inputs.prepare(None, [1], SamplingParams(prompt_logprobs=1))
    assert not seq.needs_prompt_logprobs
