"""The Triton Gated DeltaNet kernels (causal conv1d prefill and update, the gated delta rule's
varlen prefill and decode step) against their torch references, under Triton's interpreter:
ragged varlen batches, sequences without an initial state (their slot full of NaN), the null
slot 0 shared by padding decodes, a sequence split over two prefill calls, the state carried
from prefill into decode, value/key head ratios 1, 2 and 4, key and value sizes that are not
powers of two (value-dim tiles with a masked remainder). Every kernel must leave the slots it
was not given untouched.

Error analysis (u = 2^-24, float32's unit roundoff; ulp as in test_norms.py):
- Conv, float32: both sides widen the same inputs exactly and sum the same K products in tap
  order; they may differ by the rounding of each product and partial sum (a contracted
  multiply-add on a device), so by at most (K + 2) u S, S = sum |x w| <= K max|x| max|w| per
  output; SiLU's slope is within [-0.1, 1.1], and its exp and division add a few u of the
  output: bound 1.1 (K + 2) u S + 4 u |out|.
- Conv, float16/bfloat16: the float32 sums above are then rounded to the input dtype before
  SiLU; a difference of a few u can round to the neighbouring value, one ulp of the
  pre-activation y, which SiLU passes on times at most 1.1, and the output rounding adds one
  ulp of the output: 1.1 ulp(y) + ulp(out). bfloat16: the interpreter converts float32 to
  bfloat16 by truncation, not to nearest, so two ulps per rounding (as test_norms.py). The
  conv states hold raw inputs and are compared exactly.
- Delta rule, float32: the same recurrence, with sums over Dk in another order (the L2 norms,
  the prediction k^T S, the output q^T S) and, for prefill, taken token by token where the
  reference works in chunks. Each step's map S -> exp(g) (I - beta k k^T) S + beta k v^T is
  non-expansive (||k|| = 1, 0 <= beta <= 1, g <= 0), so the rounding errors of one step are
  not amplified by later ones and add up over the T tokens of a sequence: the state and the
  output (q has norm Dk^-1/2 <= 1) are within T (Dk + 8) u M of each other, M the largest
  |S| or |v| met. In these tests that is below 1e-4, the bound asked of float32.
- Delta rule, float16/bfloat16: inputs widen exactly and everything above is float32, the
  state pool included (the layer keeps it in float32); the output is rounded once more, one
  ulp of it (two for the interpreter's truncating bfloat16).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tandem.core.kernels.linear_attention_metadata import LinearAttentionMetadata
from tandem.core.kernels.reference import causal_conv1d as conv_ref
from tandem.core.kernels.reference import gated_delta_rule as delta_ref
from tandem.core.kernels.triton import causal_conv1d as conv
from tandem.core.kernels.triton import gated_delta_rule as delta

from ..reference.test_linear_attention import DK, DV, HV, Delta, K, _delta_inputs, _meta
from .test_norms import ulp

U = 2.0**-24
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ConvFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, LinearAttentionMetadata, str], torch.Tensor
]
DeltaFn = Callable[..., torch.Tensor]


def per_rounding(dtype: torch.dtype) -> float:
    """Ulps one rounding to ``dtype`` may differ by (the interpreter truncates to bfloat16)."""
    return 2.0 if dtype is torch.bfloat16 else 1.0


def check(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor | float) -> None:
    """|got - want| <= bound, elementwise."""
    err = (got.float() - want.float()).abs()
    worst = float((err / bound).max())
    assert worst <= 1.0, f"worst error {float(err.max()):.3g} is {worst:.2f} of the bound"


# --- causal conv1d -------------------------------------------------------------------------


def conv_inputs(
    tokens: int, channels: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` as a view of a wider projection (rows read in place), taps, an 8-slot pool."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, channels + 9, generator=gen).to(dtype)[:, 4 : 4 + channels]
    weight = torch.randn(channels, K, generator=gen).to(dtype)
    pool = torch.randn(8, channels, K - 1, generator=gen).to(dtype)
    return x, weight, pool


def pre_activation(
    fn: ConvFn,
    x: torch.Tensor,
    weight: torch.Tensor,
    pool: torch.Tensor,
    meta: LinearAttentionMetadata,
) -> torch.Tensor:
    """The reference conv rounded to the input dtype, before SiLU (on a copy of the pool)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(conv_ref.ACTIVATIONS, "silu", lambda y: y)
        return fn(x, weight, pool.clone(), meta, "silu")


def conv_bound(
    want: torch.Tensor, y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor
) -> torch.Tensor:
    if want.dtype is torch.float32:
        inputs = max(float(x.abs().max()), float(pool.nan_to_num(0).abs().max()))
        s = K * inputs * float(weight.abs().max())
        return 1.1 * (K + 2) * U * s + 4 * U * want.abs()
    n = per_rounding(want.dtype)
    return n * (1.1 * ulp(y, want.dtype) + ulp(want, want.dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_prefill_varlen_matches_the_reference(dtype: torch.dtype) -> None:
    """Ragged lengths (shorter than the K - 1 state inputs, and longer than a tile of
    tokens), fresh sequences whose slots hold NaN, more state rows than a tile, channels over
    two programs with a masked remainder."""
    lens, slots = [1, 2, 19, 5, 3, 1], [4, 2, 1, 3, 7, 5]
    fresh = [False, True, False, True, False, True]
    x, weight, pool = conv_inputs(sum(lens), 70, dtype, seed=1)
    pool[[2, 3, 5]] = float("nan")
    meta = _meta(lens, slots, fresh)
    y = pre_activation(conv_ref.causal_conv1d_prefill, x, weight, pool, meta)
    bound_pool = pool.clone()
    want_pool = pool.clone()
    want = conv_ref.causal_conv1d_prefill(x, weight, want_pool, meta, "silu")
    got = conv.causal_conv1d_prefill(x, weight, pool, meta, "silu")
    check(got, want, conv_bound(want, y, x, weight, bound_pool))
    assert torch.equal(pool, want_pool)  # slots 0 and 6 untouched; the rest raw inputs


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_update_matches_the_reference_beside_padding_in_the_null_slot(
    dtype: torch.dtype,
) -> None:
    """A decode batch padded with two entries on the null slot 0 (one fresh, one not), a
    fresh sequence on a slot of NaN."""
    slots, fresh = [3, 0, 1, 0, 5], [False, True, True, False, False]
    x, weight, pool = conv_inputs(len(slots), 40, dtype, seed=2)
    pool[1] = float("nan")
    meta = _meta([1] * 5, slots, fresh, num_decodes=5)
    y = pre_activation(conv_ref.causal_conv1d_update, x, weight, pool, meta)
    bound_pool = pool.clone()
    want_pool = pool.clone()
    want = conv_ref.causal_conv1d_update(x, weight, want_pool, meta, "silu")
    got = conv.causal_conv1d_update(x, weight, pool, meta, "silu")
    real = [0, 2, 4]
    check(got[real], want[real], conv_bound(want, y, x, weight, bound_pool)[real])
    assert torch.equal(pool[1:], want_pool[1:])


def test_conv_split_over_calls_then_decodes_equals_one_call() -> None:
    """One sequence prefilled over three calls (the middle one a single token) and then
    decoded token by token equals the reference over the whole sequence in one call."""
    x, weight, pool = conv_inputs(14, 24, torch.float32, seed=3)
    pool[1] = float("nan")
    whole_pool = pool.clone()
    whole = conv_ref.causal_conv1d_prefill(x, weight, whole_pool, _meta([14], [1], [True]), "silu")
    bound = conv_bound(whole, whole, x, weight, pool)  # float32: no pre-activation needed
    outs, done = [], 0
    for n in (5, 1, 4):
        meta = _meta([n], [1], [done == 0])
        outs.append(conv.causal_conv1d_prefill(x[done : done + n], weight, pool, meta, "silu"))
        done += n
    while done < 14:
        meta = _meta([1], [1], [False], num_decodes=1)
        outs.append(conv.causal_conv1d_update(x[done : done + 1], weight, pool, meta, "silu"))
        done += 1
    check(torch.cat(outs), whole, bound)
    assert torch.equal(pool[1], whole_pool[1])


# --- gated delta rule ----------------------------------------------------------------------


def in_dtype(d: Delta, dtype: torch.dtype) -> Delta:
    """The layer's dtypes: q, k, v, beta in the model dtype, the log decay g in float32."""
    return Delta(d.q.to(dtype), d.k.to(dtype), d.v.to(dtype), d.g, d.beta.to(dtype))


def run_delta(
    fn: DeltaFn, d: Delta, states: torch.Tensor, meta: LinearAttentionMetadata
) -> torch.Tensor:
    return fn(d.q, d.k, d.v, d.g, d.beta, states, meta)


def delta_bound(
    want: torch.Tensor, tokens: int, magnitude: float, key_dim: int = DK
) -> torch.Tensor | float:
    f32 = tokens * (key_dim + 8) * U * magnitude
    assert f32 <= 1e-4
    if want.dtype is torch.float32:
        return f32
    return f32 + per_rounding(want.dtype) * ulp(want, want.dtype)


def magnitude(*tensors: torch.Tensor) -> float:
    return max(float(t.float().nan_to_num(0).abs().max()) for t in tensors)


@pytest.mark.parametrize("dtype", DTYPES)
def test_delta_prefill_varlen_matches_the_reference(dtype: torch.dtype) -> None:
    """Ragged lengths (one token among them), fresh sequences on slots of NaN, continued
    sequences on random states; two value heads per key head."""
    lens, slots, fresh = [5, 11, 1, 7], [3, 1, 4, 6], [True, False, True, False]
    d = in_dtype(_delta_inputs(sum(lens), seed=1), dtype)
    states = torch.randn(8, HV, DK, DV)
    states[[3, 4]] = float("nan")
    meta = _meta(lens, slots, fresh)
    want_states = states.clone()
    want = run_delta(delta_ref.chunk_gated_delta_rule, d, want_states, meta)
    got = run_delta(delta.chunk_gated_delta_rule, d, states, meta)
    m = magnitude(states, want_states, d.v)
    check(got, want, delta_bound(want, max(lens), m))
    check(states[slots], want_states[slots], delta_bound(states, max(lens), m))
    untouched = [0, 2, 5, 7]
    assert torch.equal(states[untouched], want_states[untouched])


def test_delta_prefill_split_over_two_calls_equals_one_call() -> None:
    """A sequence prefilled in two calls (beside another sequence in each) carries its state
    from the first to the second; together they equal one call over the whole sequence."""
    d = _delta_inputs(13, seed=2)
    other = _delta_inputs(4, seed=3)
    states = torch.full((4, HV, DK, DV), float("nan"))
    whole_states = states.clone()
    whole = run_delta(delta.chunk_gated_delta_rule, d, whole_states, _meta([13], [2], [True]))
    first = run_delta(
        delta.chunk_gated_delta_rule,
        Delta.cat([other.part(0, 2), d.part(0, 6)]),
        states,
        _meta([2, 6], [1, 2], [True, True]),
    )
    second = run_delta(
        delta.chunk_gated_delta_rule,
        Delta.cat([d.part(6, 13), other.part(2, 4)]),
        states,
        _meta([7, 2], [2, 3], [False, True]),
    )
    split = torch.cat((first[2:], second[:7]))
    m = magnitude(states[2], d.v)
    check(split, whole, delta_bound(whole, 13, m))
    check(states[2], whole_states[2], delta_bound(whole, 13, m))
    ref_states = torch.full((4, HV, DK, DV), float("nan"))
    want = run_delta(delta_ref.chunk_gated_delta_rule, d, ref_states, _meta([13], [2], [True]))
    check(whole, want, delta_bound(want, 13, m))


@pytest.mark.parametrize("dtype", DTYPES)
def test_delta_decode_matches_the_reference_beside_padding_in_the_null_slot(
    dtype: torch.dtype,
) -> None:
    """A decode batch: two continued sequences, a fresh one on a slot of NaN, and two padding
    entries on the null slot 0 (which hold garbage that must not reach anyone else)."""
    slots, fresh = [2, 0, 5, 0, 1], [False, True, True, False, False]
    d = in_dtype(_delta_inputs(len(slots), seed=4), dtype)
    states = torch.randn(7, HV, DK, DV)
    states[5] = float("nan")
    meta = _meta([1] * 5, slots, fresh, num_decodes=5)
    want_states = states.clone()
    want = run_delta(delta_ref.recurrent_gated_delta_rule, d, want_states, meta)
    got = run_delta(delta.recurrent_gated_delta_rule, d, states, meta)
    real = [0, 2, 4]
    m = magnitude(states[[1, 2, 5]], want_states[[1, 2, 5]], d.v)
    check(got[real], want[real], delta_bound(want[real], 1, m))
    check(states[1:], want_states[1:], delta_bound(states, 1, m))


def test_delta_state_carries_from_prefill_into_decode() -> None:
    """A prompt prefilled by the Triton kernel, then decoded by it one token per step (beside
    another sequence), equals the reference doing the same."""
    prompt, steps = 9, 3
    d = _delta_inputs(prompt + steps, seed=5)
    other = _delta_inputs(steps, seed=6)
    states = torch.randn(4, HV, DK, DV)
    want_states = states.clone()
    prefill = _meta([prompt], [3], [True])
    got = [run_delta(delta.chunk_gated_delta_rule, d.part(0, prompt), states, prefill)]
    want = [run_delta(delta_ref.chunk_gated_delta_rule, d.part(0, prompt), want_states, prefill)]
    decode = _meta([1, 1], [1, 3], [False, False], num_decodes=2)
    for t in range(steps):
        step = Delta.cat([other.part(t, t + 1), d.part(prompt + t, prompt + t + 1)])
        got.append(run_delta(delta.recurrent_gated_delta_rule, step, states, decode)[1:])
        want.append(run_delta(delta_ref.recurrent_gated_delta_rule, step, want_states, decode)[1:])
    m = magnitude(states, want_states, d.v)
    check(torch.cat(got), torch.cat(want), delta_bound(want[0], prompt + steps, m))
    check(states, want_states, delta_bound(states, prompt + steps, m))


@pytest.mark.parametrize("key_heads", [1, 4])
def test_delta_head_ratios_odd_key_size_and_value_tiles(
    key_heads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Value heads per key head 4 and 1 (of the helper's 4 value heads), a key size of 6
    (masked in a block of 8) and a value size of 12 in tiles of 8 (two programs per head,
    the second masked), all read from strided views: a prefill of two sequences, then a
    decode step of both."""
    monkeypatch.setattr(delta, "VALUE_TILE", 8)
    key_dim, value_dim = 6, 12
    base = _delta_inputs(10, seed=7)
    q = base.q.repeat(1, 2, 1)[:, :key_heads, :key_dim]  # up to 4 key heads, strided
    k = base.k.repeat(1, 2, 1)[:, :key_heads, :key_dim]
    d = Delta(q, k, base.v[..., :value_dim], base.g, base.beta)
    states = torch.randn(3, HV, key_dim, value_dim)
    want_states = states.clone()
    prefill = _meta([3, 5], [1, 2], [False, True])
    decode = _meta([1, 1], [1, 2], [False, False], num_decodes=2)
    got = [
        run_delta(delta.chunk_gated_delta_rule, d.part(0, 8), states, prefill),
        run_delta(delta.recurrent_gated_delta_rule, d.part(8, 10), states, decode),
    ]
    want = [
        run_delta(delta_ref.chunk_gated_delta_rule, d.part(0, 8), want_states, prefill),
        run_delta(delta_ref.recurrent_gated_delta_rule, d.part(8, 10), want_states, decode),
    ]
    bound = delta_bound(want[0], 6, magnitude(states, want_states, d.v), key_dim)
    check(torch.cat(got), torch.cat(want), bound)
    check(states, want_states, bound)
