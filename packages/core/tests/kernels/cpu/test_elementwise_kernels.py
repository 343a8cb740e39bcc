"""The fused CPU elementwise kernels against the torch reference they replace: residual add +
RMSNorm, q/k RMSNorm + rotary in place (on strided views of a fused projection), gated SiLU,
in float32 and bfloat16, and the registry's choice between the two.

Tolerances are bounds derived step by step in ``rounding.py``: the kernels round every
intermediate where torch rounds it, and differ only in the order of a sum of squares and in
their exp polynomial; those differences are the seeds, propagated through each later
product and rounding. They hold on any CPU and at any ISA level (``test_isa_levels.py``
runs this module again under ``TANDEM_CPU_ISA=portable`` and ``avx2``)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tandem.core.kernels import handles
from tandem.core.kernels.cpu import elementwise as elementwise_cpu
from tandem.core.kernels.cpu import native_build
from tandem.core.kernels.cpu.elementwise import native_elementwise, native_elementwise_kernel
from tandem.core.kernels.handle import KernelHandle
from tandem.core.kernels.reference.elementwise import add_rms_norm, qk_norm_rotary, rms_norm

from .rounding import rms_norm_bound, rounded, unit_roundoff, within

needs_native = pytest.mark.skipif(
    native_elementwise() is None, reason="no C++ compiler to build the fused kernels"
)

DTYPES = [torch.float32, torch.bfloat16]


def _mostly_identical(got: torch.Tensor, want: torch.Tensor) -> None:
    """bfloat16 results differ only where a float32 value lies within the kernels' float32
    difference of a bfloat16 rounding boundary: rare (a few per ten thousand), where a
    kernel that rounds in another place than torch differs almost everywhere. (In float32
    the two sums of squares set every element of a row apart by an ulp or so.)"""
    if got.dtype is torch.bfloat16:
        assert (got != want).float().mean() < 0.02


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
    want = rms_norm(x, weight, 1e-6)
    got = kernels.rms_norm(x, weight, 1e-6)
    within(got, want, rms_norm_bound(x, weight, want, 1024, dtype))
    _mostly_identical(got, want)
    want_out, want_sum = add_rms_norm(x, residual.clone(), weight, 1e-6)
    own = residual.clone()
    got_out, got_sum = kernels.add_rms_norm(x, own, weight, 1e-6)
    # The sum is stored as torch's add stores it, and it is the caller's tensor, updated.
    assert torch.equal(got_sum, want_sum) and got_sum.data_ptr() == own.data_ptr()
    within(got_out, want_out, rms_norm_bound(want_sum, weight, want_out, 1024, dtype))
    _mostly_identical(got_out, want_out)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [True, False])
# 64 and 128 take the vectorized kernel where the CPU has AVX-512 or AVX2, 96 the portable one.
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
    inputs = q.clone(), k.clone()
    got_q, got_k = kernels.qk_norm_rotary(q, k, qw, kw, 1e-6, cos, sin, positions)
    assert got_q.data_ptr() == q.data_ptr(), "rotated in place"
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    for x, w, got, want in zip(inputs, (qw, kw), (got_q, got_k), (want_q, want_k), strict=True):
        within(got, want, _rotary_bound(x, w, c, s, want, dim, dtype))
        _mostly_identical(got, want)
    # The fused projection's v part is left alone.
    assert torch.equal(qkv[:, (q_heads + k_heads) * dim :], v_before)
    if not with_norm:
        # Without the norm no sum is involved: every product and sum rounds as torch's do.
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def _rotary_bound(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    want: torch.Tensor,
    dim: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """o1 = round(round(x1 c) - round(x2 s)), o2 = round(round(x2 c) + round(x1 s)), with x
    the normalized heads (off by the RMSNorm bound) or the inputs themselves (exact)."""
    if weight is None:
        normed, d = x.double(), torch.zeros_like(x, dtype=torch.float64)
    else:
        stored = rms_norm(x, weight, 1e-6)
        normed, d = stored.double(), rms_norm_bound(x, weight, stored, dim, dtype)
    half = dim // 2
    x1, x2, d1, d2 = normed[..., :half], normed[..., half:], d[..., :half], d[..., half:]
    c, s = cos.double(), sin.double()
    x1c, x2s = rounded(c.abs() * d1, x1 * c, dtype), rounded(s.abs() * d2, x2 * s, dtype)
    x2c, x1s = rounded(c.abs() * d2, x2 * c, dtype), rounded(s.abs() * d1, x1 * s, dtype)
    w = want.double()
    return torch.cat(
        (rounded(x1c + x2s, w[..., :half], dtype), rounded(x2c + x1s, w[..., half:], dtype)),
        dim=-1,
    )


# Where exp(-x) is clamped (x below -87.3) the kernel's SiLU is x / e^87.3 instead of -0.
_EXP_CLAMP = 2.0**-126


def _silu_bound(gate_up: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """silu = x / (1 + exp(-x)) in float32 (our exp polynomial within 2 ulp of expf, torch's
    within 1, the sum and quotient rounded once on each side: within 8 u32 of each other,
    relative), stored in ``dtype``, then times ``up`` and stored again."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    silu = gate * torch.sigmoid(gate)
    seed = silu.abs() * 8 * unit_roundoff(torch.float32) + gate.abs() * _EXP_CLAMP
    d_silu = rounded(seed, silu, dtype)
    return rounded(up.abs() * d_silu, want, dtype)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_silu(dtype: torch.dtype) -> None:
    kernels = native_elementwise()
    assert kernels is not None
    gate_up = (torch.randn(48, 2 * 2816, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    reference = handles.gated_activation("silu").impl(gate_up)
    got = kernels.silu_mul(gate_up)
    within(got, reference, _silu_bound(gate_up, reference, dtype))
    _mostly_identical(got, reference)
    # Far into both tails, where exp over- or underflows.
    tails = torch.tensor([[-200.0, -30.0, 30.0, 200.0, 1.0, 1.0, 1.0, 1.0]], dtype=dtype)
    want = handles.gated_activation("silu").impl(tails)
    within(kernels.silu_mul(tails), want, _silu_bound(tails, want, dtype))


@needs_native
def test_the_registry_picks_the_fused_kernel_where_it_handles_the_dtype() -> None:
    handle: KernelHandle[torch.Tensor] = KernelHandle(
        "rms_norm", rms_norm, native_elementwise_kernel("rms_norm")
    )
    assert handle.choose("cpu", torch.bfloat16) != rms_norm
    assert handle.choose("cpu", torch.float16) is rms_norm
    assert handle.choose("npu", torch.bfloat16) is rms_norm
    gelu = handles.gated_activation("gelu")
    assert gelu.choose("cpu", torch.float32) is gelu.impl


def test_without_a_compiler_the_layers_run_op_by_op(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(native_build, "find_cxx", lambda: None)
    with caplog.at_level(logging.DEBUG, logger=elementwise_cpu.__name__):
        assert elementwise_cpu.load_native_elementwise(Path("/nonexistent")) is None
    assert "run op by op in torch" in caplog.text
    monkeypatch.setenv("TANDEM_ELEMENTWISE", "torch")
    assert elementwise_cpu.load_native_elementwise() is None


@needs_native
def test_the_build_runs_the_code_path_of_its_isa_level() -> None:
    """Under TANDEM_CPU_ISA=portable an AVX-512 machine runs the plain loops an old CPU
    runs, and under avx2 what an AVX2 machine runs (``test_isa_levels.py``)."""
    kernels = native_elementwise()
    assert kernels is not None
    assert kernels.compiled_path == native_build.expected_path(native_build.selected_isa())
