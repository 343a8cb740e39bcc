"""The CPU kernels' verify path: each verifying sequence's positions run in order in one call,
the state after each but the last kept in its scratch row. It does per token exactly what the
decode kernel does, in the same order, so it must equal, bit for bit, the reference's
position-by-position loop driven by the native decode step: outputs, the sequences' states
and every scratch row, float32 and bfloat16, sequences of different lengths (a lone token
too), q/k/v as strided views of one projection. The registry hands it to the layer on CPU."""

from __future__ import annotations

import pytest
import torch

from tandem.core.kernels import handles
from tandem.core.kernels.cpu.linear_attention import NativeLinearAttention, native_linear_attention
from tandem.core.kernels.linear_attention_metadata import (
    LinearVerifyIndices,
    build_linear_attention_metadata,
)
from tandem.core.kernels.reference.linear_attention_verify import conv_verify, delta_verify

LENS = [3, 1, 4, 2]
SLOTS = [5, 2, 7, 1]
# Scratch rows, sequence by sequence, one per position but the last: 2 + 0 + 3 + 1.
SCRATCH = [9, 10, 11, 12, 13, 14]
ROWS = 16


@pytest.fixture(scope="module")
def kernel() -> NativeLinearAttention:
    found = native_linear_attention()
    if found is None:
        pytest.skip("no native linear-attention kernels (no compiler, or switched off)")
    return found


def _verify() -> LinearVerifyIndices:
    lens = torch.tensor(LENS)
    meta = build_linear_attention_metadata(
        lens,
        lens + 10,  # every verifying sequence continues a state
        torch.tensor(SLOTS),
        num_decodes=0,
        conv_kernel_size=4,
        device=torch.device("cpu"),
        num_verifies=len(LENS),
        verify_scratch=torch.tensor(SCRATCH),
    )
    assert meta.verify is not None
    return meta.verify


def delta_inputs(
    gen: torch.Generator, tokens: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """q, k, v as the layer gets them (strided views of one projection's rows), the log
    decay g and beta, for ``tokens`` tokens."""
    proj = torch.randn(tokens, 2 * hk * dk + hv * dv + 5, generator=gen).to(dtype)
    q = proj[:, : hk * dk].view(tokens, hk, dk)
    k = proj[:, hk * dk : 2 * hk * dk].view(tokens, hk, dk)
    v = proj[:, 2 * hk * dk : 2 * hk * dk + hv * dv].view(tokens, hv, dv)
    g = -torch.rand(tokens, hv, generator=gen)
    beta = torch.rand(tokens, hv, generator=gen).to(dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_verify_equals_the_decode_step_position_by_position(
    kernel: NativeLinearAttention, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(3)
    hv, dk, dv = 4, 64, 64
    q, k, v, g, beta = delta_inputs(gen, sum(LENS), 2, hv, dk, dv, dtype)
    states = torch.randn(ROWS, hv, dk, dv, generator=gen)
    want_states = states.clone()
    verify = _verify()
    got = kernel.recurrent_verify(q, k, v, g, beta, states, verify, kernel.recurrent)
    want = delta_verify(q, k, v, g, beta, want_states, verify, kernel.recurrent)
    assert torch.equal(got, want)
    assert torch.equal(states, want_states)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_verify_equals_the_decode_step_position_by_position(
    kernel: NativeLinearAttention, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(4)
    channels, taps = 96, 4
    x = torch.randn(sum(LENS), channels + 8, generator=gen).to(dtype)[:, :channels]
    weight = torch.randn(channels, taps, generator=gen).to(dtype)
    states = torch.randn(ROWS, channels, taps - 1, generator=gen).to(dtype)
    before = states.clone()
    want_states = states.clone()
    verify = _verify()
    got = kernel.conv_verify(x, weight, states, verify, "silu", kernel.conv_update)
    want = conv_verify(x, weight, want_states, verify, "silu", kernel.conv_update)
    assert torch.equal(got, want)
    assert torch.equal(states, want_states)
    # The lone token's sequence keeps nothing; the others' scratch rows changed.
    assert not torch.equal(states[SCRATCH], before[SCRATCH])


def test_the_layer_gets_the_native_verify_kernels_on_cpu(kernel: NativeLinearAttention) -> None:
    for handle, name in (
        (handles.recurrent_gated_delta_verify(), "recurrent_verify"),
        (handles.causal_conv1d_verify(), "conv_verify"),
    ):
        for dtype in (torch.float32, torch.bfloat16):
            chosen = handle.choose(["cpu"], dtype)
            assert getattr(chosen, "__func__", None) is getattr(type(kernel), name)
