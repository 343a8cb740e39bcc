"""The native prefill of Gated DeltaNet's conv and delta rule: the same arithmetic, token for
token, as the decode step (``test_linear_attention.py`` bounds that one against the rule in
float64), so a prefill is checked bit for bit against feeding its tokens one position at a
time through the native decode step: runs of unequal lengths, fresh sequences on slots of
NaN (their old state must not be read), runs shorter than the conv's window, q/k/v and conv
inputs read from strided views of one projection, float32 and bfloat16. Against the torch
reference (the chunked form, another summation order) the layer's outputs agree within a
float32 tolerance; the registry hands the native kernels to the layer on CPU.
"""

from __future__ import annotations

import pytest
import torch

from tandem.core.kernels import handles
from tandem.core.kernels.cpu.linear_attention import NativeLinearAttention, native_linear_attention
from tandem.core.kernels.linear_attention_metadata import LinearAttentionMetadata
from tandem.core.kernels.reference.causal_conv1d import causal_conv1d_prefill
from tandem.core.kernels.reference.gated_delta_rule import chunk_gated_delta_rule

from ..reference.test_linear_attention import _meta
from .test_linear_attention_verify import delta_inputs

# Runs of unequal lengths (one shorter than the conv's 3 kept inputs, one of a single token);
# fresh ones start from zeros on a slot filled with NaN.
LENS = [5, 1, 9, 2, 70]
SLOTS = [3, 1, 6, 2, 5]
FRESH = [True, False, True, False, False]
ROWS = 8


@pytest.fixture(scope="module")
def kernel() -> NativeLinearAttention:
    found = native_linear_attention()
    if found is None:
        pytest.skip("no native linear-attention kernels (no compiler, or switched off)")
    return found


def _poisoned(states: torch.Tensor) -> torch.Tensor:
    for slot, fresh in zip(SLOTS, FRESH, strict=True):
        if fresh:
            states[slot] = float("nan")
    return states


def _positions() -> list[tuple[list[int], LinearAttentionMetadata]]:
    """Per position j: the tokens (rows of the prefill) at j, and decode metadata for their
    sequences, continuing a state unless fresh and at position 0."""
    starts = [sum(LENS[:i]) for i in range(len(LENS))]
    steps = []
    for j in range(max(LENS)):
        seqs = [i for i, n in enumerate(LENS) if n > j]
        fresh = [FRESH[i] and j == 0 for i in seqs]
        meta = _meta([1] * len(seqs), [SLOTS[i] for i in seqs], fresh, num_decodes=len(seqs))
        steps.append(([starts[i] + j for i in seqs], meta))
    return steps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_prefill_equals_the_decode_step_position_by_position(
    kernel: NativeLinearAttention, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(5)
    hv, dk, dv = 4, 64, 32
    q, k, v, g, beta = delta_inputs(gen, sum(LENS), 2, hv, dk, dv, dtype)
    states = _poisoned(torch.randn(ROWS, hv, dk, dv, generator=gen))
    want_states = states.clone()

    got = kernel.recurrent_prefill(q, k, v, g, beta, states, _meta(LENS, SLOTS, FRESH))

    want = torch.empty_like(got)
    for rows, meta in _positions():
        r = torch.tensor(rows)
        want[r] = kernel.recurrent(q[r], k[r], v[r], g[r], beta[r], want_states, meta)
    assert torch.equal(got, want)
    # Every run's slot written alike (no NaN left in the fresh ones); the others untouched.
    assert torch.equal(states, want_states)


# 4 taps: the decode step's compiled-for kernel size; 3: its run-time one.
@pytest.mark.parametrize("taps", [3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_prefill_equals_the_decode_step_position_by_position(
    kernel: NativeLinearAttention, dtype: torch.dtype, taps: int
) -> None:
    gen = torch.Generator().manual_seed(6)
    channels = 96
    x = torch.randn(sum(LENS), channels + 8, generator=gen).to(dtype)[:, 3 : 3 + channels]
    weight = torch.randn(channels, taps, generator=gen).to(dtype)
    states = _poisoned(torch.randn(ROWS, channels, taps - 1, generator=gen).to(dtype))
    want_states = states.clone()

    got = kernel.conv_prefill(x, weight, states, _meta(LENS, SLOTS, FRESH), "silu")

    want = torch.empty_like(got)
    for rows, meta in _positions():
        r = torch.tensor(rows)
        want[r] = kernel.conv_update(x[r], weight, want_states, meta, "silu")
    assert torch.equal(got, want)
    assert torch.equal(states, want_states)


def test_the_layer_gets_the_native_prefill_kernels_and_they_match_the_chunked_reference(
    kernel: NativeLinearAttention,
) -> None:
    for handle, name in (
        (handles.chunk_gated_delta_rule(), "recurrent_prefill"),
        (handles.causal_conv1d_prefill(), "conv_prefill"),
    ):
        chosen = handle.choose(["cpu"], torch.bfloat16)
        assert getattr(chosen, "__func__", None) is getattr(type(kernel), name)
    gen = torch.Generator().manual_seed(8)
    tokens, hk, hv, dk, dv, channels = sum(LENS), 2, 4, 16, 16, 48
    q, k = torch.randn(tokens, hk, dk, generator=gen), torch.randn(tokens, hk, dk, generator=gen)
    v, g = torch.randn(tokens, hv, dv, generator=gen), -torch.rand(tokens, hv, generator=gen)
    beta = torch.rand(tokens, hv, generator=gen)
    meta = _meta(LENS, SLOTS, FRESH, chunk_size=8)
    states = torch.randn(ROWS, hv, dk, dv, generator=gen)
    want_states = states.clone()
    got = kernel.recurrent_prefill(q, k, v, g, beta, states, meta)
    want = chunk_gated_delta_rule(q, k, v, g, beta, want_states, meta)
    # Both float32 (the chunked form solves a triangular system per chunk): values of order
    # 1-10 agree to a few float32 ulps times the sequence length.
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states, want_states, rtol=1e-4, atol=1e-4)

    x = torch.randn(tokens, channels, generator=gen)
    weight = torch.randn(channels, 4, generator=gen)
    conv_states = torch.randn(ROWS, channels, 3, generator=gen)
    want_conv_states = conv_states.clone()
    got = kernel.conv_prefill(x, weight, conv_states, meta, "silu")
    want = causal_conv1d_prefill(x, weight, want_conv_states, meta, "silu")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The states hold raw inputs: exact.
    assert torch.equal(conv_states, want_conv_states)
