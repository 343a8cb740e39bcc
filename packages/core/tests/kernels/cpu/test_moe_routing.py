"""The native MoE routing kernels against the torch reference they replace
(``reference/fused_moe.py``): the sort (``sort_rows``) and the gather (``index_select``)
exactly; the sums (``combine``) bit for bit (each product rounded to the dtype, then added in
float32 in expert order and rounded once, as mul_ and index_add_ into zeros do); the router's
top-k (``topk_softmax``) with the same experts, its weights within the bound its test derives.
Skipped where the library cannot be built; run at every ISA level by the suite's switch."""

from __future__ import annotations

import pytest
import torch

from tandem.core.kernels.cpu.moe_routing import NativeMoeRouting, native_moe_routing
from tandem.core.kernels.reference.fused_moe import combine, sort_rows, topk_softmax


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "experts", "k", "normalize"),
                         [(1, 4, 1, False), (61, 8, 2, True), (300, 60, 4, False),
                          (97, 128, 8, True), (40, 256, 4, True), (33, 512, 10, True),
                          (600, 512, 8, False), (0, 8, 2, True)])  # fmt: skip
def test_the_router_choice_is_the_references(
    tokens: int, experts: int, k: int, normalize: bool, dtype: torch.dtype
) -> None:
    """The same experts in the same order as ``topk_softmax``, ties included: bfloat16 logits
    of a spread of 4 tie often (3 significant digits), and torch.topk's order among tied
    experts is its algorithm's (both of its paths are taken here: k * 64 <= E and not; 600 x
    512 logits go parallel, 0 tokens give empty outputs).

    The weights: both sides compute exp(l - max) / S over E terms in float32, exp within 2
    ulps (ours, fast_exp) and 1 (torch's), S summed in another order (each partial sum one
    rounding: at most E ulps of S apart in all), then one division here and a multiplication
    by 1 / S there, and as much again over the k chosen to renormalise. An ulp is at most
    2^-23 of its value, and a weight is at most 1: (E + k + 6) 2^-23 apart. bfloat16 rounds
    each once more, and where the float32 values fall either side of a rounding boundary
    they end one bfloat16 step apart: at most 2^-7 of the weight (8 significant bits)."""
    routing = _routing()
    g = torch.Generator().manual_seed(experts + k)
    logits = (torch.randn(tokens, experts, generator=g) * 4).to(dtype)
    want_weights, want_ids = topk_softmax(logits, k, normalize)
    # Where the router's matmul leaves them: a view of wider, padded rows.
    padded = torch.zeros(tokens, experts + 24, dtype=dtype)
    padded[:, :experts] = logits
    weights, ids = routing.topk_softmax(padded[:, :experts], k, normalize)
    assert ids.dtype is torch.int64 and weights.dtype is dtype
    assert ids.shape == weights.shape == (tokens, k)
    assert torch.equal(ids, want_ids)
    got, want = weights.float(), want_weights.float()
    bound = torch.full_like(want, (experts + k + 6) * 2.0**-23)
    if dtype is torch.bfloat16:
        bound += 2.0**-7 * torch.maximum(got.abs(), want.abs())
    assert bool(((got - want).abs() <= bound).all())


@pytest.mark.parametrize("k", [0, 9])
def test_a_top_k_outside_the_experts_is_refused(k: int) -> None:
    with pytest.raises(ValueError, match="top_k must be from 1 to the router's 8 experts"):
        _routing().topk_softmax(torch.randn(3, 8), k, True)


def test_half_precision_logits_are_refused_with_a_clear_error() -> None:
    """The kernel handle gives float16 to the torch reference; a direct call says why not."""
    with pytest.raises(ValueError, match="float32 or bfloat16 logits"):
        _routing().topk_softmax(torch.randn(3, 8).half(), 2, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "k", "hidden"), [(1, 1, 64), (61, 2, 96), (700, 8, 512)])
def test_the_gather_is_index_select(tokens: int, k: int, hidden: int, dtype: torch.dtype) -> None:
    """The sorted pairs' rows of x, each where the route sends it (700 x 8 x 512 rows go
    parallel)."""
    routing = _routing()
    ids = _route(tokens, k, 16, seed=k)
    _, token, _ = routing.route(ids, 16)
    x = torch.randn(tokens, hidden + 8).to(dtype)[:, :hidden]  # rows apart, as a view's
    assert torch.equal(routing.gather(x, token), x.index_select(0, token))


def test_a_token_outside_x_is_refused_before_anything_is_read() -> None:
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="outside the 4 rows of x"):
        _routing().gather(x, torch.tensor([0, 3, 4]))
    with pytest.raises(ValueError, match="contiguous int64"):
        _routing().gather(x, torch.tensor([0, 3], dtype=torch.int32))
