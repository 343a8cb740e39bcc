"""The Triton MoE router choice (softmax, top k, renormalise) against its torch reference,
under Triton's interpreter: expert counts that are and are not a power of two, several tiles of
tokens with a partial last one, logits read through a token stride, every k up to all experts.

The logits of a row are distinct, far enough apart that the expert ids must agree exactly;
exact ties are tested apart (the lower id first, as the kernel promises).

Error analysis of the weights (u = 2^-24): each side computes p = exp(x - max) / sum in float32
(the reference multiplies by the reciprocal of the sum: one more rounding). exp is within an
ulp (2 u) on each side; a sum of E positive terms in any order within (E - 1) u relative; the
quotient 2 u. So |p - p_ref| <= 2 (E + 4) u p. Renormalising divides by the sum of the k
weights taken (k - 1 roundings, relative) and rounds once more: another 2 (k + 1) u. Both
bounded together as 2 (E + k + 6) u relative; a result in float16 or bfloat16 adds its one
rounding (two ulps for the interpreter's truncating bfloat16)."""

from __future__ import annotations

import pytest
import torch

from tandem.core.kernels.reference.fused_moe import topk_softmax as reference
from tandem.core.kernels.triton import topk_softmax as triton_topk

from .test_linear_attention import U, check, per_rounding
from .test_norms import ulp

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def distinct_logits(tokens: int, experts: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[tokens, experts] logits, a view into a wider buffer (token stride experts + 3), each
    row a shuffle of distinct values a quarter apart (exact in every dtype here)."""
    gen = torch.Generator().manual_seed(seed)
    grid = (torch.arange(experts, dtype=torch.float64) - experts / 2) / 4
    rows = torch.stack([grid[torch.randperm(experts, generator=gen)] for _ in range(tokens)])
    wide = torch.full((tokens, experts + 3), 99.0, dtype=torch.float64)
    wide[:, 1 : experts + 1] = rows
    logits = wide.to(dtype)[:, 1 : experts + 1]
    assert all(len(set(row.tolist())) == experts for row in logits), "distinct in the dtype"
    return logits


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 8, 2), (37, 128, 8), (5, 60, 4)])
def test_topk_softmax_matches_the_reference(
    dtype: torch.dtype, normalize: bool, tokens: int, experts: int, top_k: int
) -> None:
    logits = distinct_logits(tokens, experts, dtype, seed=tokens + experts)
    want_weights, want_ids = reference(logits, top_k, normalize)
    weights, ids = triton_topk.topk_softmax(logits, top_k, normalize)
    assert weights.dtype is dtype and ids.dtype is torch.int64
    assert weights.shape == ids.shape == (tokens, top_k)
    assert torch.equal(ids, want_ids)
    bound = 2 * (experts + top_k + 6) * U * want_weights.double().abs()
    if dtype is not torch.float32:
        bound = bound + per_rounding(dtype) * ulp(want_weights, dtype).double()
    check(weights, want_weights, bound)


def test_every_expert_taken_sums_to_one_when_renormalised() -> None:
    logits = distinct_logits(3, 6, torch.float32, seed=1)
    weights, ids = triton_topk.topk_softmax(logits, 6, normalize=True)
    assert torch.equal(ids, logits.argsort(dim=-1, descending=True))
    check(weights.sum(dim=-1), torch.ones(3), 16 * U)


def test_ties_go_to_the_lower_expert_id() -> None:
    logits = torch.tensor([[0.5, 2.0, -1.0, 2.0, 2.0], [3.0, 3.0, 3.0, 3.0, 3.0]])
    weights, ids = triton_topk.topk_softmax(logits, 3, normalize=False)
    assert ids.tolist() == [[1, 3, 4], [0, 1, 2]]
    want = torch.softmax(logits, dim=-1).topk(3, dim=-1).values
    check(weights, want, 8 * U * want)


def test_no_tokens_launch_nothing_and_a_bad_k_is_refused() -> None:
    weights, ids = triton_topk.topk_softmax(torch.empty(0, 8), 2, normalize=True)
    assert weights.shape == ids.shape == (0, 2)
    with pytest.raises(ValueError, match="top_k 9"):
        triton_topk.topk_softmax(torch.zeros(1, 8), 9, normalize=True)
