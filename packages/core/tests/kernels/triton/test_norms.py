"""The Triton RMSNorm kernels (plain, with the residual add, gated, zero-centred) against
their torch references, under Triton's interpreter.

Tolerances, from where the two computations differ:
- float32: only in the order of the sum of squares (a float32 sum of n positive terms is
  within gamma_n = n u of exact in any order, u = 2^-24) and in 1/sqrt against rsqrt (a few
  u); the scale factor moves by at most half of gamma_n plus those, relatively, and so does
  every output element. Bound: (n / 2 + 8) u |ref|, far inside the 1e-4 the issue asks.
- float16: the float32 values above then round to float16 once or twice (the normalised row
  before the weight, the product after it); a float32 difference of a few u can carry a
  rounding to the neighbouring float16, so one float16 ulp of |ref| per rounding.
- bfloat16: as float16, but the interpreter converts float32 to bfloat16 by truncation, not
  to nearest (half of all values differ from torch's conversion; Triton's debugging guide
  says its bfloat16 support is partial): each rounding can land one more ulp away, so two
  bfloat16 ulps per rounding. On a device the cast rounds to nearest; the device check
  compares there.
The residual sum is one addition rounded once on both sides: equal in float32 and float16,
within one bfloat16 ulp under the interpreter's truncation.
"""

from __future__ import annotations

import pytest
import torch

from tandem.core.kernels.reference import elementwise as reference
from tandem.core.kernels.triton import norms

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at |x| (at its smallest normal below that)."""
    tiny = torch.finfo(dtype).tiny
    mag = x.abs().float().clamp_min(tiny)
    return torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(mag)))


def assert_close(got: torch.Tensor, want: torch.Tensor, roundings: int, n: int) -> None:
    dtype = want.dtype
    err = (got.float() - want.float()).abs()
    if dtype is torch.float32:
        bound = (n / 2 + 8) * 2.0**-24 * want.abs() + 1e-30
    else:
        per_rounding = 1 if dtype is torch.float16 else 2
        bound = roundings * per_rounding * ulp(want, dtype)
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"{dtype}: {worst:.2f} of the bound"


def inputs(dtype: torch.dtype, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 3, n, generator=gen).to(dtype)
    other = torch.randn(7, 3, n, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype)
    return x, other, weight


@pytest.mark.parametrize("n", [64, 96, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_the_reference(dtype: torch.dtype, n: int) -> None:
    x, _, weight = inputs(dtype, n, seed=n)
    assert_close(norms.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), 2, n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_writes_the_sum_into_the_residual(dtype: torch.dtype) -> None:
    x, residual, weight = inputs(dtype, 128, seed=1)
    want, want_sum = reference.add_rms_norm(x, residual, weight, 1e-6)
    handed = residual.clone()
    got, got_sum = norms.add_rms_norm(x, handed, weight, 1e-6)
    assert got_sum.data_ptr() == handed.data_ptr()
    if dtype is torch.bfloat16:
        assert_close(got_sum, want_sum, 1, 128)
        # The norm of a sum that may already differ by an ulp: one more rounding's worth.
        assert_close(got, want, 3, 128)
    else:
        assert torch.equal(got_sum, want_sum)
        assert_close(got, want, 2, 128)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm_matches_the_reference(dtype: torch.dtype) -> None:
    x, gate, weight = inputs(dtype, 128, seed=2)
    want = reference.rms_norm_gated(x, gate, weight, 1e-6)
    assert_close(norms.rms_norm_gated(x, gate, weight, 1e-6), want, 3, 128)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_centred_rms_norm_matches_the_reference(dtype: torch.dtype) -> None:
    x, _, weight = inputs(dtype, 128, seed=3)
    want = reference.rms_norm_zero_centered(x, weight - 1, 1e-6)
    assert_close(norms.rms_norm_zero_centered(x, weight - 1, 1e-6), want, 1, 128)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_centred_add_rms_norm_writes_the_sum_into_the_residual(dtype: torch.dtype) -> None:
    x, residual, weight = inputs(dtype, 128, seed=4)
    want, want_sum = reference.add_rms_norm_zero_centered(x, residual, weight - 1, 1e-6)
    handed = residual.clone()
    got, got_sum = norms.add_rms_norm_zero_centered(x, handed, weight - 1, 1e-6)
    assert got_sum.data_ptr() == handed.data_ptr()
    if dtype is torch.bfloat16:
        # As the plain add above: the sum may differ by an ulp, its norm by one more.
        assert_close(got_sum, want_sum, 1, 128)
        assert_close(got, want, 2, 128)
    else:
        assert torch.equal(got_sum, want_sum)
        assert_close(got, want, 1, 128)


def test_rows_of_a_wider_tensor_are_read_in_place() -> None:
    """A view with a row stride wider than its rows (q split from a fused projection)."""
    wide = torch.randn(5, 200)
    x = wide[:, 8:136]
    weight = torch.rand(128) + 0.5
    assert_close(norms.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), 2, 128)
