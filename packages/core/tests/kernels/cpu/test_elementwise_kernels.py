"""The fused CPU elementwise kernels against the torch reference they replace: residual add +
RMSNorm, q/k RMSNorm + rotary in place (on strided views of a fused projection), gated SiLU,
the gated RMSNorm (on strided views), Gated DeltaNet's gates, in float32 and bfloat16, and
the registry's choice between the two.

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
from tandem.core.kernels.reference.elementwise import (
    add_rms_norm,
    add_rms_norm_zero_centered,
    rms_norm,
    rms_norm_gated,
    rms_norm_zero_centered,
)
from tandem.core.kernels.reference.gated_delta_rule import gdn_gating

from ..gating import gating_inputs
from .rounding import (
    check_qk_norm_rotary_in_place,
    mostly_identical,
    rms_norm_bound,
    rounded,
    sum_of_squares_seed,
    unit_roundoff,
    within,
)

needs_native = pytest.mark.skipif(
    native_elementwise() is None, reason="no C++ compiler to build the fused kernels"
)

DTYPES = [torch.float32, torch.bfloat16]


def _mostly_identical(got: torch.Tensor, want: torch.Tensor) -> None:
    """In bfloat16 (in float32 the two sums of squares set every element of a row apart by
    an ulp or so)."""
    if got.dtype is torch.bfloat16:
        mostly_identical(got, want)


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


def zero_centered_bound(
    h: torch.Tensor, weight: torch.Tensor, want: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``round(h * inv * (1 + w))`` twice, rounded once each: the scales differ by the
    sum-of-squares seed, and each side's float32 products h * inv, (1 + w) and their product
    add 3 u of float32 before the one rounding to ``dtype``."""
    hf = h.double()
    normalized = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)
    relative = sum_of_squares_seed(h.shape[-1], dtype) + 6 * unit_roundoff(torch.float32)
    exact = normalized.abs() * (1 + weight.double()).abs()
    return rounded(exact * relative, want, dtype)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 48])
def test_zero_centered_rms_norm_and_residual_add(dtype: torch.dtype, rows: int) -> None:
    """Qwen3.5's norm (scale 1 + weight, rounded once), alone and after the residual add."""
    kernels = native_elementwise()
    assert kernels is not None
    g = torch.Generator().manual_seed(rows + 1)
    x = torch.randn(rows, 1024, generator=g).to(dtype) * 3
    residual = torch.randn(rows, 1024, generator=g).to(dtype)
    weight = (0.3 * torch.randn(1024, generator=g)).to(dtype)  # an offset from one
    want = rms_norm_zero_centered(x, weight, 1e-6)
    got = kernels.rms_norm_zero_centered(x, weight, 1e-6)
    within(got, want, zero_centered_bound(x, weight, want, dtype))
    _mostly_identical(got, want)
    want_out, want_sum = add_rms_norm_zero_centered(x, residual.clone(), weight, 1e-6)
    own = residual.clone()
    got_out, got_sum = kernels.add_rms_norm_zero_centered(x, own, weight, 1e-6)
    assert torch.equal(got_sum, want_sum) and got_sum.data_ptr() == own.data_ptr()
    within(got_out, want_out, zero_centered_bound(want_sum, weight, want_out, dtype))
    _mostly_identical(got_out, want_out)
    # Read as a plain RMSNorm weight (scale w, not 1 + w) it would be far off.
    assert not torch.allclose(kernels.rms_norm(x, weight, 1e-6).float(), want.float(), atol=0.1)


@needs_native
def test_rms_norm_of_a_strided_weight_reads_a_live_copy() -> None:
    """A non-contiguous weight is copied for the kernel; the copy must outlive the call. Many
    calls, each freeing a block the next allocation can reuse, make a dangling pointer show."""
    kernels = native_elementwise()
    assert kernels is not None
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 1024, generator=g)
    strided = (1 + 0.1 * torch.randn(2048, generator=g))[::2]
    assert not strided.is_contiguous()
    want = rms_norm(x, strided.contiguous(), 1e-6)
    for _ in range(50):
        got = kernels.rms_norm(x, strided, 1e-6)
        torch.full((1024,), float("nan"))  # reuses a freed copy's block, if one was freed
        within(got, want, rms_norm_bound(x, strided, want, 1024, torch.float32))


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
    kernel = kernels.qk_norm_rotary
    pairs = check_qk_norm_rotary_in_place(kernel, dtype, dim, with_norm, (37, 16, 8), seed=1)
    for got, want in pairs:
        _mostly_identical(got, want)
    if not with_norm:
        # Without the norm no sum is involved: every product and sum rounds as torch's do.
        assert all(torch.equal(got, want) for got, want in pairs)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [True, False])
# (head, rotated): the bench hybrid's (128, 32) and Qwen3.5's (256, 64) take the vectorized
# kernel with AVX-512, as a whole head of 64 does; (64, 16) and (96, 32) the portable one.
@pytest.mark.parametrize(
    ("dim", "rotary_dim"), [(128, 32), (256, 64), (64, 64), (64, 16), (96, 32)]
)
def test_zero_centered_norm_and_partial_rotary_in_place_inside_the_gated_projection(
    dtype: torch.dtype, with_norm: bool, dim: int, rotary_dim: int
) -> None:
    """Qwen3.5's gated attention: q read through its strides between the output gates."""
    kernels = native_elementwise()
    assert kernels is not None
    pairs = check_qk_norm_rotary_in_place(
        kernels.qk_norm_rotary, dtype, dim, with_norm, (37, 6, 2), seed=dim + rotary_dim,
        zero_centered=True, rotary_dim=rotary_dim,
    )  # fmt: skip
    for got, want in pairs:
        _mostly_identical(got, want)
        if not with_norm:
            # No sum involved: every product and sum rounds as torch's, the rest untouched.
            assert torch.equal(got, want)


@needs_native
def test_qk_norm_rotary_refuses_tables_of_another_rotated_width() -> None:
    kernels = native_elementwise()
    assert kernels is not None
    q, k = torch.zeros(3, 2, 64), torch.zeros(3, 1, 64)
    cos = sin = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="rotary_dim / 2"):
        kernels.qk_norm_rotary(q, k, None, None, 1e-6, cos, sin, torch.zeros(3), False, 64)


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


def gated_bound(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    want: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``round(y * silu(gate))`` twice, ``y = round(w * round(x * inv))`` the weighted norm:
    the two y differ by ``rms_norm_bound`` (the sum-of-squares seed, the same roundings), the
    two SiLUs as in ``_silu_bound`` (8 u of float32 relative, plus the exp clamp's tail); the
    product of each side is rounded to float32 (u each) before the one rounding to ``dtype``.
    In bfloat16 that leaves a difference of an ulp where a value lies on a rounding boundary;
    in float32 a relative difference of about (D + 12) u."""
    y = rms_norm(x, weight, 1e-6)  # the reference's weighted norm, rounded as it rounds it
    d_y = rms_norm_bound(x, weight, y, x.shape[-1], dtype)
    gf = gate.double()
    silu = gf * torch.sigmoid(gf)
    d_silu = silu.abs() * 8 * unit_roundoff(torch.float32) + gf.abs() * _EXP_CLAMP
    yf = y.double().abs()
    diff = silu.abs() * d_y + (yf + d_y) * d_silu
    diff = diff + 2 * unit_roundoff(torch.float32) * (yf + d_y) * (silu.abs() + d_silu)
    return rounded(diff, want, dtype)


def _gated_inputs(
    dtype: torch.dtype, tokens: int, heads: int, dim: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x and gate [tokens, heads, dim], sections of one wider projection (a token's row is
    longer than its heads, as the layer's ``z`` is), and a weight near one."""
    g = torch.Generator().manual_seed(seed)
    width = heads * dim
    projection = (torch.randn(tokens, 3 * width + 5, generator=g) * 3).to(dtype)
    x = projection[:, 5 : 5 + width].view(tokens, heads, dim)
    gate = projection[:, 2 * width + 5 :].view(tokens, heads, dim)
    weight = (1 + 0.1 * torch.randn(dim, generator=g)).to(dtype)
    return x, gate, weight


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
# 1024 tokens of 8 x 64 are enough elements for the kernel to share rows among threads.
@pytest.mark.parametrize("tokens", [1, 7, 64, 1024])
def test_gated_rms_norm_reads_strided_sections_of_a_projection(
    dtype: torch.dtype, tokens: int
) -> None:
    """Qwen3.5's gated norm of [T, H, D] views (token rows wider than their heads)."""
    kernels = native_elementwise()
    assert kernels is not None
    x, gate, weight = _gated_inputs(dtype, tokens, 8, 64, seed=tokens)
    assert tokens == 1 or (x.stride(0) > 8 * 64 and gate.stride(0) > 8 * 64)
    want = rms_norm_gated(x, gate, weight, 1e-6)
    got = kernels.rms_norm_gated(x, gate, weight, 1e-6)
    assert got.shape == want.shape and got.is_contiguous()
    within(got, want, gated_bound(x, gate, weight, want, dtype))
    _mostly_identical(got, want)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [65, 128])  # an odd size takes the loops' remainders
def test_gated_rms_norm_of_strided_rows(dtype: torch.dtype, dim: int) -> None:
    """[N, D] rows at a stride above D (one head per row), a row as small as eps, and the
    tails of the SiLU, where exp over- or underflows."""
    kernels = native_elementwise()
    assert kernels is not None
    x, gate, weight = _gated_inputs(dtype, 37, 1, dim, seed=dim)
    x, gate = x.squeeze(1), gate.squeeze(1)
    assert x.stride(0) > dim and gate.stride(0) > dim
    gate[0, :4] = torch.tensor([-200.0, -30.0, 30.0, 200.0], dtype=dtype)
    x[1] *= 1e-3  # mean(x^2) near eps: a row whose scale eps sets
    want = rms_norm_gated(x, gate, weight, 1e-6)
    got = kernels.rms_norm_gated(x, gate, weight, 1e-6)
    within(got, want, gated_bound(x, gate, weight, want, dtype))
    _mostly_identical(got, want)
    with pytest.raises(ValueError, match="not shaped as x"):
        kernels.rms_norm_gated(x, gate[:, :-1], weight, 1e-6)


def gating_bounds(
    a_log: torch.Tensor, want_g: torch.Tensor, b: torch.Tensor, want_beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """g = -exp(A_log) * softplus(a + dt_bias) in float32 on both sides (the sum a + dt_bias
    is one float32 add, alike): exp(A_log) within an ulp (2 u) of exact on each side (the C
    library's, torch's); exp(x) within 2 ulp (fast_exp) and 1 ulp (torch's), which log1p
    carries over at most as they are (d log1p(e) / d e <= log1p(e) / e); the logs within 4
    ulp (fast_log with Goldberg's quotient: its series, k ln 2 and the quotient's roundings)
    and 1 ulp; the product rounded on each side: under 32 u relative. Where a + dt_bias is
    below -87.3 fast_exp returns e^-87.3 < 2^-125 instead of less: |exp(A_log)| 2^-125
    more. beta = sigmoid(b) as the gated SiLU's (8 u, the same clamp's tail 2^-126), rounded
    to the dtype once."""
    u = unit_roundoff(torch.float32)
    decay = a_log.double().exp()
    d_g = want_g.double().abs() * 32 * u + decay * 2.0**-125
    sigmoid = torch.sigmoid(b.double())
    d_beta = rounded(sigmoid * 8 * u + 2.0**-126, want_beta, want_beta.dtype)
    return d_g, d_beta


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
# 8,192 tokens of 8 heads are enough elements for the kernel to share blocks among threads.
@pytest.mark.parametrize("tokens", [1, 7, 48, 1024, 8192])
def test_gdn_gating_reads_the_columns_of_a_projection(dtype: torch.dtype, tokens: int) -> None:
    """(g, beta) from b and a, the two halves of one [T, 2H] projection, over the range
    of the softplus (past its threshold 20, and far enough below zero that exp underflows)."""
    kernels = native_elementwise()
    assert kernels is not None
    # -87.5: below where fast_exp clamps.
    tails = [-200.0, -95.0, -87.5, -30.0, 0.0, 19.9, 20.5, 90.0]
    b, a, a_log, dt_bias = gating_inputs(dtype, tokens, tails, seed=tokens)
    want_g, want_beta = gdn_gating(a, b, a_log, dt_bias)
    got_g, got_beta = kernels.gdn_gating(a, b, a_log, dt_bias)
    assert got_g.dtype is torch.float32 and got_beta.dtype is dtype
    d_g, d_beta = gating_bounds(a_log, want_g, b, want_beta)
    within(got_g, want_g, d_g)
    within(got_beta, want_beta, d_beta)
    _mostly_identical(got_beta, want_beta)


@needs_native
def test_gdn_gating_refuses_mismatched_arguments() -> None:
    kernels = native_elementwise()
    assert kernels is not None
    a, b, heads = torch.randn(4, 8), torch.randn(4, 8), torch.zeros(8)
    with pytest.raises(ValueError, match="share a dtype"):
        kernels.gdn_gating(a, b, heads.bfloat16(), heads)
    with pytest.raises(ValueError, match=r"\[T, H\]"):
        kernels.gdn_gating(a, b[:, :4], heads, heads)


@needs_native
def test_the_registry_picks_the_fused_kernel_where_it_handles_the_dtype() -> None:
    handle: KernelHandle[torch.Tensor] = KernelHandle(
        "rms_norm", rms_norm, native_elementwise_kernel("rms_norm")
    )
    assert handle.choose(("cpu",), torch.bfloat16) != rms_norm
    assert handle.choose(("cpu",), torch.float16) is rms_norm
    assert handle.choose(("torch_npu", "triton"), torch.bfloat16) is rms_norm
    gelu = handles.gated_activation("gelu")
    assert gelu.choose(("cpu",), torch.float32) is gelu.impl
    gated = handles.rms_norm_gated()
    assert gated.choose(("cpu",), torch.bfloat16) != rms_norm_gated
    gating = handles.gdn_gating()
    assert gating.choose(("cpu",), torch.bfloat16) != gdn_gating


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
