"""Error bounds for comparing two implementations of one rounded computation (a fused kernel
against the torch ops it replaces), derived step by step instead of read off one CPU.

Two facts carry every bound here:

- Rounding to a format is monotone and moves a value by at most half a unit in the last
  place (ulp) of its binade, so if two exact values differ by ``d``, their rounded values
  differ by at most ``d + ulp(max(|a|, |b|))``.
- A product ``w * x`` whose input ``x`` is off by ``dx`` is off by ``|w| * dx`` before it is
  rounded.

A kernel and its reference differ only where they compute something in another order or by
another formula (a sum of squares, an exp polynomial): that is the seed ``d`` each bound
starts from; every later step adds the propagated difference and one ulp of its result.
"""

from __future__ import annotations

import torch

# Significant bits (with the implicit one) of each storage format.
_PRECISION = {torch.float32: 24, torch.bfloat16: 8}
_TINY = {torch.float32: 2.0**-126, torch.bfloat16: 2.0**-126}


def unit_roundoff(dtype: torch.dtype) -> float:
    """u: a rounding to ``dtype`` moves a value by at most u times its magnitude."""
    return 2.0 ** -_PRECISION[dtype]


def ulp(magnitude: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` values in the binade of each ``|magnitude|`` (float64;
    subnormals get the smallest normal's spacing, an upper bound)."""
    m = magnitude.double().abs().clamp_min(_TINY[dtype])
    _, exponent = torch.frexp(m)
    return torch.ldexp(torch.ones_like(m), exponent - _PRECISION[dtype])


def rounded(diff: torch.Tensor, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bound after rounding two values that differed by at most ``diff`` exactly, one of
    them ``value``: ``diff`` plus one ulp at the larger of the two magnitudes."""
    return diff + ulp(value.double().abs() + diff, dtype)


def within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    """Every element of ``got`` within ``bound`` of ``want`` (the worst one is reported)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    error = (got.double() - want.double()).abs()
    excess = error - bound
    worst = int(excess.argmax())
    assert bool((excess <= 0).all()), (
        f"element {worst}: got {got.flatten()[worst].item()!r}, want "
        f"{want.flatten()[worst].item()!r}, bound {bound.flatten()[worst].item():.3g}"
    )


def sum_of_squares_seed(dim: int, dtype: torch.dtype) -> float:
    """Relative difference two float32 RMSNorm scales ``rsqrt(mean(h^2) + eps)`` of one row
    may have when their sums of squares run in different orders: a sum of ``dim`` positive
    terms is within (dim - 1) u of exact in any order (Higham, Accuracy and Stability,
    sec. 4.2), so two sums differ by 2 (dim - 1) u; the square root halves a relative error;
    the mean, eps, sqrt and division (or rsqrt) add at most 4 u on each side. ``dtype`` is the
    storage format; the arithmetic is float32 for both."""
    del dtype
    u = unit_roundoff(torch.float32)
    return (dim - 1) * u + 8 * u


def rms_norm_bound(
    h: torch.Tensor, weight: torch.Tensor, want: torch.Tensor, dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """Bound for ``round(w * round(h * inv))`` computed twice with scales ``inv`` off by the
    sum-of-squares seed: ``h`` the (stored) inputs, ``want`` the reference output."""
    hf = h.double()
    scale = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)
    normalized = hf * scale
    seed = normalized.abs() * sum_of_squares_seed(dim, dtype)
    d_normalized = rounded(seed, normalized, dtype)
    return rounded(weight.double().abs() * d_normalized, want, dtype)
