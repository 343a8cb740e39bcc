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
- Delta rule, float32: the same recurrence, the prefill in chunks on both sides (the kernel's
  of BT tokens, the reference's of its metadata's size, the same or shorter), with sums in
  another order and ``I + A`` inverted by forward substitution where the reference solves the
  triangular system. The map a chunk applies to the state, S -> exp(gc_last) S + Kw^T (U - W
  S), is the product of its tokens' steps S -> exp(g) (I - beta k k^T) S + beta k v^T, each
  non-expansive (||k|| = 1, 0 <= beta <= 1, g <= 0), so the rounding errors of one chunk are
  not amplified by later ones and add up over the chunks. Within a chunk every state or output
  entry is a few products over Dk (W S, q S, the norms) and over BT (Aqk V, Kw^T V), W, U and
  Aqk themselves products over BT with the inverse; so a chunk adds about (Dk + 2 BT + 8) u M,
  M the largest |S| or |v| met, and C chunks C (Dk + 2 BT + 8) u M (a decode step is a chunk
  of one token). A model, not a proof (it does not follow the size of the inverse's
  entries); measured, the worst float32 error is 6.5% of it (a decode step's state; 5.3% in
  the prefill, the states after two chunks of 64). Every float32 bound here is below 1e-4,
  the bound asked of float32.
- Delta rule, float16/bfloat16: inputs widen exactly and everything above is float32, the
  state pool included (the layer keeps it in float32); the output is rounded once more, one
  ulp of it (two for the interpreter's truncating bfloat16).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tandem.core.kernels.linear_attention_metadata import (
    LinearAttentionMetadata,
    build_linear_attention_metadata,
)
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
    want: torch.Tensor, magnitude: float, chunks: list[int], key_dim: int = DK
) -> torch.Tensor | float:
    """The float32 model above over ``chunks`` (their sizes BT, 1 for a decode step), plus the
    output rounding for the narrower dtypes."""
    f32 = sum(key_dim + 2 * size + 8 for size in chunks) * U * magnitude
    assert f32 <= 1e-4
    if want.dtype is torch.float32:
        return f32
    return f32 + per_rounding(want.dtype) * ulp(want, want.dtype)


def kernel_chunks(meta: LinearAttentionMetadata, length: int) -> list[int]:
    """The chunks the prefill kernel takes a sequence of ``length`` tokens in (their size)."""
    assert meta.prefill is not None
    size = max(delta.MIN_DOT, min(delta.CHUNK_SIZE, meta.prefill.chunk_size))
    return [size] * -(-length // size)


def magnitude(*tensors: torch.Tensor) -> float:
    return max(float(t.float().nan_to_num(0).abs().max()) for t in tensors)


def test_delta_prefill_varlen_matches_the_reference() -> None:
    """Ragged lengths in chunks of 16 (1, 5, exactly 16, 17, three chunks the last partial),
    fresh sequences on slots of NaN, continued sequences on random states, and two padding
    entries on the null slot 0 (one fresh, one continuing the NaN there, which must reach no
    one else); two value heads per key head. Float32 (the narrower dtypes below)."""
    lens, slots = [5, 16, 1, 17, 1, 37, 1], [3, 1, 4, 6, 0, 2, 0]
    fresh = [True, False, True, False, True, False, False]
    real = [0, 1, 2, 3, 5]
    d = _delta_inputs(sum(lens), seed=1)
    states = torch.randn(8, HV, DK, DV)
    states[[0, 3, 4]] = float("nan")
    meta = _meta(lens, slots, fresh, chunk_size=16)
    want_states = states.clone()
    want = run_delta(delta_ref.chunk_gated_delta_rule, d, want_states, meta)
    got = run_delta(delta.chunk_gated_delta_rule, d, states, meta)
    tokens = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    is_real = torch.isin(tokens, torch.tensor(real))
    m = magnitude(states[1:], want_states[1:], d.v)
    bound = delta_bound(want, m, kernel_chunks(meta, max(lens)))
    check(got[is_real], want[is_real], bound)
    check(states[1:], want_states[1:], bound)
    untouched = [5, 7]
    assert torch.equal(states[untouched], want_states[untouched])


def test_delta_prefill_after_verifying_sequences_reads_its_own_bounds() -> None:
    """A step of a hybrid model with speculative drafts: a decode, two sequences verifying
    drafts (3 and 2 tokens, run by the decode kernels), then two prefill chunks. The prefill
    kernel gets the prefill tokens only, and must find each chunk's bounds past the verifying
    sequences, not past the decodes alone."""
    lens, slots = [1, 3, 2, 7, 5], [1, 2, 3, 4, 5]
    query_lens = torch.tensor(lens)
    meta = build_linear_attention_metadata(
        query_lens,
        query_lens + torch.tensor([50, 50, 50, 0, 20]),
        torch.tensor(slots),
        num_decodes=1,
        conv_kernel_size=K,
        device=torch.device("cpu"),
        num_verifies=2,
        verify_scratch=torch.tensor([10, 11, 12]),
    )
    d = _delta_inputs(12, seed=4)
    states = torch.randn(16, HV, DK, DV)
    want_states = states.clone()
    want = run_delta(delta_ref.chunk_gated_delta_rule, d, want_states, meta)
    got = run_delta(delta.chunk_gated_delta_rule, d, states, meta)
    bound = delta_bound(want, magnitude(states, want_states, d.v), kernel_chunks(meta, 7))
    check(got, want, bound)
    check(states[[4, 5]], want_states[[4, 5]], bound)


@pytest.mark.parametrize("dtype", DTYPES)
def test_delta_prefill_in_chunks_of_64_matches_the_reference(dtype: torch.dtype) -> None:
    """The full chunk of 64 tokens: exactly one chunk, one token, one chunk and one more;
    the model's dtypes (the state pool float32, as the layer keeps it)."""
    lens, slots, fresh = [64, 1, 65], [2, 3, 1], [False, True, True]
    d = in_dtype(_delta_inputs(sum(lens), seed=8), dtype)
    states = torch.randn(4, HV, DK, DV)
    states[[1, 3]] = float("nan")
    meta = _meta(lens, slots, fresh)
    assert kernel_chunks(meta, 65) == [64, 64]
    want_states = states.clone()
    want = run_delta(delta_ref.chunk_gated_delta_rule, d, want_states, meta)
    got = run_delta(delta.chunk_gated_delta_rule, d, states, meta)
    m = magnitude(states, want_states, d.v)
    check(got, want, delta_bound(want, m, kernel_chunks(meta, 65)))
    check(states, want_states, delta_bound(states, m, kernel_chunks(meta, 65)))
    assert torch.equal(states[0], want_states[0])


def test_delta_prefill_split_over_two_calls_equals_one_call() -> None:
    """A sequence prefilled in two calls (beside another sequence in each, the split inside a
    chunk of the whole) carries its state from the first to the second through its slot;
    together they equal one call over the whole sequence."""
    d = _delta_inputs(40, seed=2)
    other = _delta_inputs(4, seed=3)
    states = torch.full((4, HV, DK, DV), float("nan"))
    whole_states = states.clone()
    whole_meta = _meta([40], [2], [True], chunk_size=16)
    whole = run_delta(delta.chunk_gated_delta_rule, d, whole_states, whole_meta)
    first_meta = _meta([2, 23], [1, 2], [True, True], chunk_size=16)
    first = run_delta(
        delta.chunk_gated_delta_rule,
        Delta.cat([other.part(0, 2), d.part(0, 23)]),
        states,
        first_meta,
    )
    second_meta = _meta([17, 2], [2, 3], [False, True], chunk_size=16)
    second = run_delta(
        delta.chunk_gated_delta_rule,
        Delta.cat([d.part(23, 40), other.part(2, 4)]),
        states,
        second_meta,
    )
    split = torch.cat((first[2:], second[:17]))
    m = magnitude(states[2], d.v)
    chunks = kernel_chunks(whole_meta, 40)
    both = chunks + kernel_chunks(first_meta, 23) + kernel_chunks(second_meta, 17)
    check(split, whole, delta_bound(whole, m, both))
    check(states[2], whole_states[2], delta_bound(whole, m, both))
    ref_states = torch.full((4, HV, DK, DV), float("nan"))
    want = run_delta(delta_ref.chunk_gated_delta_rule, d, ref_states, whole_meta)
    check(whole, want, delta_bound(want, m, chunks))


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
    check(got[real], want[real], delta_bound(want[real], m, [1]))
    check(states[1:], want_states[1:], delta_bound(states, m, [1]))


def test_delta_state_carries_from_prefill_into_decode() -> None:
    """A prompt of two chunks prefilled by the Triton kernel, then decoded by it one token per
    step (beside another sequence), equals the reference doing the same."""
    prompt, steps = 20, 3
    d = _delta_inputs(prompt + steps, seed=5)
    other = _delta_inputs(steps, seed=6)
    states = torch.randn(4, HV, DK, DV)
    want_states = states.clone()
    prefill = _meta([prompt], [3], [True], chunk_size=16)
    got = [run_delta(delta.chunk_gated_delta_rule, d.part(0, prompt), states, prefill)]
    want = [run_delta(delta_ref.chunk_gated_delta_rule, d.part(0, prompt), want_states, prefill)]
    decode = _meta([1, 1], [1, 3], [False, False], num_decodes=2)
    for t in range(steps):
        step = Delta.cat([other.part(t, t + 1), d.part(prompt + t, prompt + t + 1)])
        got.append(run_delta(delta.recurrent_gated_delta_rule, step, states, decode)[1:])
        want.append(run_delta(delta_ref.recurrent_gated_delta_rule, step, want_states, decode)[1:])
    m = magnitude(states, want_states, d.v)
    bound = delta_bound(want[0], m, kernel_chunks(prefill, prompt) + [1] * steps)
    check(torch.cat(got), torch.cat(want), bound)
    check(states, want_states, bound)


@pytest.mark.parametrize("key_heads", [1, 4])
def test_delta_head_ratios_odd_key_size_and_value_tiles(
    key_heads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Value heads per key head 4 and 1 (of the helper's 4 value heads), a key size of 6
    (masked in a block of 16) and a value size of 20 in tiles of 16 (two programs per head,
    the second masked), all read from strided views: a prefill of two sequences, then a
    decode step of both."""
    monkeypatch.setattr(delta, "VALUE_TILE", 16)
    key_dim, value_dim = 6, 20
    base = _delta_inputs(10, seed=7)
    q = base.q.repeat(1, 2, 1)[:, :key_heads, :key_dim]  # up to 4 key heads, strided
    k = base.k.repeat(1, 2, 1)[:, :key_heads, :key_dim]
    v = torch.randn(10, HV, value_dim + 3, generator=torch.Generator().manual_seed(9))
    d = Delta(q, k, v[..., 1 : 1 + value_dim], base.g, base.beta)
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
    chunks = [*kernel_chunks(prefill, 5), 1]
    bound = delta_bound(want[0], magnitude(states, want_states, d.v), chunks, key_dim)
    check(torch.cat(got), torch.cat(want), bound)
    check(states, want_states, bound)
