"""The native MoE routing kernels (sort by expert, sum back) against the torch reference they
replace (``reference/fused_moe.py``: ``sort_rows``, ``combine``): the same sort, and the same
sums bit for bit (each product rounded to the dtype, then added in float32 in expert order
and rounded once, as mul_ and index_add_ into zeros do), so no tolerance is needed. Skipped
where the library cannot be built; run at every ISA level by the suite's switch."""

from __future__ import annotations

import pytest
import torch

from tandem.core.kernels.cpu.moe_routing import NativeMoeRouting, native_moe_routing
from tandem.core.kernels.reference.fused_moe import combine, sort_rows


def _routing() -> NativeMoeRouting:
    routing = native_moe_routing()
    if routing is None:
        pytest.skip("no native MoE routing library here (no compiler?)")
    return routing


def _route(tokens: int, k: int, experts: int, seed: int) -> torch.Tensor:
    """Each token's k distinct experts, in descending router order as topk gives them."""
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed))
    return torch.topk(logits, k, dim=-1).indices


@pytest.mark.parametrize(("tokens", "k", "experts"), [(1, 1, 4), (61, 2, 8), (300, 8, 128)])
def test_the_sort_is_the_references(tokens: int, k: int, experts: int) -> None:
    routing = _routing()
    ids = _route(tokens, k, experts, seed=tokens)
    order, token, offsets = sort_rows(ids, experts)
    got_offsets, got_token, slot = routing.route(ids, experts)
    assert torch.equal(got_offsets, offsets)
    assert torch.equal(got_token, token)
    # slot is order's inverse: pair order[r] went to sorted row r.
    assert torch.equal(slot[order], torch.arange(tokens * k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "k", "experts", "hidden"), [(1, 1, 4, 64), (61, 2, 8, 96),
                                                                  (300, 8, 128, 200)])  # fmt: skip
def test_the_sum_back_is_the_references_bit_for_bit(
    tokens: int, k: int, experts: int, hidden: int, dtype: torch.dtype
) -> None:
    routing = _routing()
    g = torch.Generator().manual_seed(hidden)
    ids = _route(tokens, k, experts, seed=hidden)
    weights = torch.softmax(torch.randn(tokens, k, generator=g), -1).to(dtype)
    # Magnitudes spread over 2^-8 .. 2^8, so sums of products round, in any order.
    scale = torch.exp2(torch.randint(-8, 9, (tokens * k, 1), generator=g).float())
    rows = (torch.randn(tokens * k, hidden, generator=g) * scale).to(dtype)
    order, token, _ = sort_rows(ids, experts)
    x = torch.empty(tokens, hidden, dtype=dtype)
    want = combine(x, rows.clone(), order, token, weights)
    _, _, slot = routing.route(ids, experts)
    got = routing.combine(rows, weights, slot)
    assert got.dtype is dtype
    assert torch.equal(got, want)


def test_an_expert_id_outside_the_layer_is_refused() -> None:
    routing = _routing()
    for bad in (8, -1):
        ids = torch.tensor([[0, 3], [bad, 1]])
        with pytest.raises(ValueError, match="outside the layer's 8 experts"):
            routing.route(ids, 8)


def test_rows_or_slots_that_do_not_match_the_pairs_are_refused() -> None:
    routing = _routing()
    weights = torch.full((4, 2), 0.5)
    _, _, slot = routing.route(torch.tensor([[0, 1]] * 4), 2)
    with pytest.raises(ValueError, match="one slot and one row"):
        routing.combine(torch.ones(7, 16), weights, slot)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        routing.combine(torch.ones(8, 16, dtype=torch.float16), weights, slot)
