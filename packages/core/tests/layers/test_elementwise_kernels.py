"""The fused CPU elementwise kernels against the torch reference they replace: residual add +
RMSNorm, q/k RMSNorm + rotary in place (on strided views of a fused projection), gated SiLU;
float32 to rounding, bfloat16 to one unit in the last place at most (sums of squares and exp
are computed in another order than torch's), and the registry's choice between the two."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tandem.core.layers import elementwise_cpu, native_build
from tandem.core.layers.activation import gated_activation_kernel
from tandem.core.layers.elementwise_cpu import native_elementwise
from tandem.core.layers.kernels import (
    KernelHandle,
    add_rms_norm,
    native_elementwise_kernel,
    qk_norm_rotary,
    rms_norm,
)

needs_native = pytest.mark.skipif(
    native_elementwise() is None, reason="no C++ compiler to build the fused kernels"
)

DTYPES = [torch.float32, torch.bfloat16]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between ``a`` and ``b`` in units of their last place."""
    if a.dtype is torch.bfloat16:
        ai, bi = a.view(torch.int16).int(), b.view(torch.int16).int()
    else:
        ai, bi = a.view(torch.int32).long(), b.view(torch.int32).long()
    return int((ai - bi).abs().max())


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype is torch.bfloat16:
        assert _ulps(got, want) <= 1
        # Nearly everything is bit for bit the same; one-ulp differences are rare.
        assert (got != want).float().mean() < 0.02
    else:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 48, 600])
def test_rms_norm_and_residual_add(dtype: torch.dtype, rows: int) -> None:
    kernels = native_elementwise()
    assert kernels is not None
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1024, generator=g).to(dtype) * 3
    residual = torch.randn(rows, 1024, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(1024, generator=g)).to(dtype)
    _close(kernels.rms_norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6))
    want_out, want_sum = add_rms_norm(x, residual.clone(), weight, 1e-6)
    own = residual.clone()
    got_out, got_sum = kernels.add_rms_norm(x, own, weight, 1e-6)
    # The sum is stored as torch's add stores it, and it is the caller's tensor, updated.
    assert torch.equal(got_sum, want_sum) and got_sum.data_ptr() == own.data_ptr()
    _close(got_out, want_out)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [True, False])
# 64 and 128 take the vectorized kernel where the CPU has AVX-512, 96 the portable one.
@pytest.mark.parametrize("dim", [64, 128, 96])
def test_qk_norm_rotary_in_place_on_a_fused_projection(
    dtype: torch.dtype, with_norm: bool, dim: int
) -> None:
    kernels = native_elementwise()
    assert kernels is not None
    tokens, q_heads, k_heads = 37, 16, 8
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * dim, generator=g).to(dtype)
    q, k, _ = torch.split(qkv, [q_heads * dim, k_heads * dim, k_heads * dim], dim=-1)
    q, k = q.view(tokens, q_heads, dim), k.view(tokens, k_heads, dim)
    freqs = torch.outer(torch.arange(512).float(), torch.rand(dim // 2, generator=g))
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    positions = torch.randint(0, 512, (tokens,), generator=g)
    weights = [(1 + 0.1 * torch.randn(dim, generator=g)).to(dtype) for _ in range(2)]
    qw, kw = weights if with_norm else (None, None)
    want_q, want_k = qk_norm_rotary(q.clone(), k.clone(), qw, kw, 1e-6, cos, sin, positions)
    v_before = qkv[:, (q_heads + k_heads) * dim :].clone()
    got_q, got_k = kernels.qk_norm_rotary(q, k, qw, kw, 1e-6, cos, sin, positions)
    assert got_q.data_ptr() == q.data_ptr(), "rotated in place"
    _close(got_q, want_q)
    _close(got_k, want_k)
    # The fused projection's v part is left alone.
    assert torch.equal(qkv[:, (q_heads + k_heads) * dim :], v_before)
    if not with_norm:
        # Without the norm no sum is involved: every product and sum rounds as torch's do.
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_silu(dtype: torch.dtype) -> None:
    kernels = native_elementwise()
    assert kernels is not None
    gate_up = (torch.randn(48, 2 * 2816, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    reference = gated_activation_kernel("silu").impl(gate_up)
    _close(kernels.silu_mul(gate_up), reference)
    # Far into both tails, where exp over- or underflows.
    tails = torch.tensor([[-200.0, -30.0, 30.0, 200.0, 1.0, 1.0, 1.0, 1.0]], dtype=dtype)
    _close(kernels.silu_mul(tails), gated_activation_kernel("silu").impl(tails))


@needs_native
def test_the_registry_picks_the_fused_kernel_where_it_handles_the_dtype() -> None:
    handle: KernelHandle[torch.Tensor] = KernelHandle(
        "rms_norm", rms_norm, native_elementwise_kernel("rms_norm")
    )
    assert handle.choose("cpu", torch.bfloat16) != rms_norm
    assert handle.choose("cpu", torch.float16) is rms_norm
    assert handle.choose("npu", torch.bfloat16) is rms_norm
    gelu = gated_activation_kernel("gelu")
    assert gelu.choose("cpu", torch.float32) is gelu.impl


def test_without_a_compiler_the_layers_run_op_by_op(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(native_build, "find_cxx", lambda: None)
    with caplog.at_level(logging.WARNING, logger=elementwise_cpu.__name__):
        assert elementwise_cpu.load_native_elementwise(Path("/nonexistent")) is None
    assert "run op by op in torch" in caplog.text
    monkeypatch.setenv("TANDEM_ELEMENTWISE", "torch")
    assert elementwise_cpu.load_native_elementwise() is None
