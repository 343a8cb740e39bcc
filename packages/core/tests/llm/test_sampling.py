"""Sampling: seeded reproducibility independent of the batch, top-k/top-p, logprobs."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tandem.core import InvalidRequestError, LLMEngine, SamplingParams
from tandem.core.llm.forward_input import SamplingBatch
from tandem.core.llm.sampler import (
    Sampler,
    apply_top_k_top_p,
    inverse_cdf_sample,
    top_k_top_p_by_sort,
)


def _batch(n: int, **kw: object) -> SamplingBatch:
    fields: dict[str, object] = {
        "temperatures": torch.ones(n),
        "top_p": torch.ones(n),
        "top_k": torch.zeros(n, dtype=torch.int64),
        "seeds": (None,) * n,
        "steps": (0,) * n,
        "all_greedy": False,
        "needs_top_k_top_p": False,
        "max_logprobs": None,
    }
    fields.update(kw)
    return SamplingBatch(**fields)  # type: ignore[arg-type]


def test_top_k_top_p_masks() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    out = apply_top_k_top_p(logits, torch.tensor([2, 0]), torch.tensor([1.0, 0.7]))
    kept = torch.isfinite(out)
    assert kept.tolist() == [[True, True, False, False], [True, True, False, False]]
    # Kept logits are unchanged.
    assert torch.equal(out[kept], logits[kept])


@pytest.mark.parametrize("vocab", [600, 20000])
def test_the_cut_among_the_largest_logits_equals_a_full_sort(vocab: int) -> None:
    # Rows of every kind: peaked and flat distributions (a flat one's nucleus is thousands
    # of tokens, past the first candidate width), small and huge top-k, top-p alone, both,
    # neither; against the full-sort reference.
    gen = torch.Generator().manual_seed(vocab)
    scales = torch.tensor([8.0, 8.0, 3.0, 0.5, 0.5, 8.0, 3.0, 1.0, 0.1, 2.0])
    logits = torch.randn(10, vocab, generator=gen) * scales.unsqueeze(1)
    top_k = torch.tensor([0, 5, 0, 0, vocab - 1, 40, 2000, 0, 0, 9000])
    top_p = torch.tensor([0.9, 1.0, 0.9, 0.95, 1.0, 0.5, 0.8, 1.0, 0.3, 0.99])
    fast = apply_top_k_top_p(logits, top_k, top_p)
    slow = top_k_top_p_by_sort(logits, top_k, top_p)
    assert torch.equal(torch.isfinite(fast), torch.isfinite(slow))
    kept = torch.isfinite(fast)
    assert torch.equal(fast[kept], logits[kept])
    # Real cuts happened (the case is not vacuous): the peaked top-p row keeps few tokens.
    assert 0 < int(kept[0].sum()) < vocab // 10 and int(kept[1].sum()) == 5


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    sampler = Sampler(seed=1)
    logits = torch.log(probs).expand(4000, 4).clone()
    tokens = torch.tensor(sampler(logits, _batch(4000)).token_ids)
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert freq[3] == 0
    assert torch.allclose(freq, probs, atol=0.04)


def test_tokens_of_probability_zero_are_never_drawn() -> None:
    # Zeros first, between and last: each is a flat step of the cumulative sums, which the
    # inversion must never land on, and the rest keep their shares.
    probs = torch.tensor([0.0, 0.5, 0.0, 0.0, 0.25, 0.0, 0.25, 0.0])
    logits = torch.log(probs).expand(8000, 8).clone()
    tokens = torch.tensor(Sampler(seed=2)(logits, _batch(8000)).token_ids)
    freq = torch.bincount(tokens, minlength=8).float() / 8000
    assert freq[probs == 0].sum() == 0
    assert torch.allclose(freq, probs, atol=0.03)


@pytest.mark.parametrize("vocab", [7, 1000, 16384, 151936])
def test_inverse_cdf_matches_a_whole_vocabulary_running_sum(vocab: int) -> None:
    # The two-level search picks the token a float64 running sum over the whole row picks,
    # for vocabularies that fill their last block and ones that do not, with most of the
    # mass on few tokens (as after top-k) and some rows where it ends in a zero.
    gen = torch.Generator().manual_seed(vocab)
    probs = (torch.randn(64, vocab, generator=gen) * 4).softmax(dim=-1)
    probs[::3, vocab // 2 :] = 0.0
    uniform = torch.rand(64, 1, dtype=torch.float64, generator=gen)
    cdf = probs.double().cumsum(dim=-1)
    expected = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(1)
    assert torch.equal(inverse_cdf_sample(probs, uniform), expected)
    edges = inverse_cdf_sample(probs, torch.tensor([[0.0], [1.0 - 2**-53]]).repeat(32, 1))
    assert bool((probs.gather(1, edges.unsqueeze(1)) > 0).all())


def test_seeded_row_ignores_its_neighbours() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(seed=0)
    alone = sampler(logits[1:2], _batch(1, seeds=(7,), steps=(3,))).token_ids
    for _ in range(5):
        batched = sampler(logits, _batch(3, seeds=(None, 7, None), steps=(0, 3, 0))).token_ids
        assert batched[1] == alone[0]


def test_greedy_rows_in_a_random_batch_take_the_argmax() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(3))
    batch = _batch(4, temperatures=torch.tensor([0.0, 1.0, 0.0, 2.0]))
    tokens = Sampler(seed=0)(logits, batch).token_ids
    assert tokens[0] == logits[0].argmax().item()
    assert tokens[2] == logits[2].argmax().item()


def test_logprobs_are_the_model_distribution() -> None:
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(5))
    out = Sampler(seed=0)(logits, _batch(2, all_greedy=True, max_logprobs=3))
    ref = logits.log_softmax(-1)
    assert out.logprobs is not None and out.top_token_ids is not None
    assert out.top_logprobs is not None
    for row in range(2):
        assert math.isclose(out.logprobs[row], ref[row].max().item(), abs_tol=1e-6)
        assert out.top_token_ids[row][0] == out.token_ids[row]
        assert out.top_logprobs[row] == sorted(out.top_logprobs[row], reverse=True)


def _run(engine: LLMEngine, prompts: list[str], params: list[SamplingParams]) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(prompts, params)]


def test_seeded_requests_reproduce_across_runs_and_batches(
    demo_dir: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    engine = make_engine(demo_dir, max_tokens_per_batch=16)
    seeded = SamplingParams(
        max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True
    )
    first = _run(engine, ["hello world"], [seeded])[0]
    assert _run(engine, ["hello world"], [seeded])[0] == first
    other = SamplingParams(max_tokens=12, temperature=1.3, ignore_eos=True)
    mixed = _run(
        engine,
        ["the model reads", "hello world", "Question: what is 1 + 2?"],
        [other, seeded, SamplingParams(max_tokens=5, seed=9)],
    )
    assert mixed[1] == first
    # Another engine (another process would do the same): same seed, same tokens.
    assert _run(make_engine(demo_dir), ["hello world"], [seeded])[0] == first
    different = SamplingParams(max_tokens=20, temperature=1.0, seed=4321, ignore_eos=True)
    assert _run(engine, ["hello world"], [different])[0] != first


def test_top_k_one_is_greedy(demo_dir: Path, make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine(demo_dir)
    greedy = _run(engine, ["hello world"], [SamplingParams.greedy(max_tokens=10)])
    topk1 = _run(engine, ["hello world"], [SamplingParams(max_tokens=10, temperature=1.5, top_k=1)])
    assert topk1 == greedy


def test_engine_logprobs(demo_dir: Path, make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine(demo_dir)
    [out] = engine.generate(["hello"], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3))
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 4
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token
        assert len(lp.top) == 3
        assert lp.top[0][0] == token and math.isclose(lp.top[0][1], lp.logprob, abs_tol=1e-6)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"max_tokens": -3},
        {"temperature": -0.5},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"logprobs": 99},
        {"stop": [""]},
    ],
)
def test_invalid_sampling_params(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]
