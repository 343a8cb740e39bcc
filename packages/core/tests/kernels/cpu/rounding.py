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

from collections.abc import Callable

import torch

from tandem.core.kernels.reference.elementwise import (
    qk_norm_rotary,
    rms_norm,
    rms_norm_zero_centered,
)

# Significant bits (with the implicit one) of each storage format.
_PRECISION = {torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}
_TINY = {torch.float32: 2.0**-126, torch.float16: 2.0**-14, torch.bfloat16: 2.0**-126}


def unit_roundoff(dtype: torch.dtype) -> float:
    """u: a rounding to ``dtype`` moves a value by at most u times its magnitude."""
    return 2.0 ** -_PRECISION[dtype]


def ulp(magnitude: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` values in the binade of each ``|magnitude|`` (float64;
    subnormals get the smallest normal's spacing, an upper bound)."""
    m = magnitude.double().abs().clamp_min(_TINY[dtype])
    _, exponent = torch.frexp(m)
    return torch.ldexp(torch.ones_like(m), exponent - _PRECISION[dtype])


def rounded(
    diff: torch.Tensor, value: torch.Tensor, dtype: torch.dtype, ulps: float = 1.0
) -> torch.Tensor:
    """The bound after rounding two values that differed by at most ``diff`` exactly, one of
    them ``value``: ``diff`` plus one ulp at the larger of the two magnitudes (``ulps``
    where one side rounds otherwise: 1.5 where it truncates, as Triton's interpreter
    converts to bfloat16)."""
    return diff + ulps * ulp(value.double().abs() + diff, dtype)


def mostly_identical(got: torch.Tensor, want: torch.Tensor, limit: float = 0.02) -> None:
    """Two implementations that round at the same places differ only where a float32 value
    lies within their float32 difference of a rounding boundary of the storage format:
    rare (a few per thousand), where one that rounds in another place differs in a large
    share of the elements (every other one, typically)."""
    assert (got != want).float().mean() < limit


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
    h: torch.Tensor,
    weight: torch.Tensor,
    want: torch.Tensor,
    dim: int,
    dtype: torch.dtype,
    ulps: float = 1.0,
    zero_centered: bool = False,
) -> torch.Tensor:
    """Bound for ``round(w * round(h * inv))`` computed twice with scales ``inv`` off by the
    sum-of-squares seed: ``h`` the (stored) inputs, ``want`` the reference output (``ulps``
    per rounding as ``rounded``). ``zero_centered`` (Qwen3.5's norm): ``round(h * inv *
    (1 + w))``, rounded once to ``dtype``; both sides round the two float32 products
    ``h * inv`` and ``* (1 + w)`` (u each, relative), and those roundings now fall on
    different values: 2 u per side on top of the seed, relative to the exact result."""
    hf = h.double()
    scale = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)
    normalized = hf * scale
    seed = normalized.abs() * sum_of_squares_seed(dim, dtype)
    if zero_centered:
        value = normalized * (1.0 + weight.double())
        u = unit_roundoff(torch.float32)
        return rounded(value.abs() * (sum_of_squares_seed(dim, dtype) + 4 * u), want, dtype, ulps)
    d_normalized = rounded(seed, normalized, dtype, ulps)
    return rounded(weight.double().abs() * d_normalized, want, dtype, ulps)


def rotary_bound(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    want: torch.Tensor,
    dim: int,
    dtype: torch.dtype,
    ulps: float = 1.0,
    zero_centered: bool = False,
) -> torch.Tensor:
    """o1 = round(round(x1 c) - round(x2 s)), o2 = round(round(x2 c) + round(x1 s)), with x
    the normalized heads (off by the RMSNorm bound, ``zero_centered``: Qwen3.5's) or the
    inputs themselves (exact); ``ulps`` per rounding as ``rounded``. Partial rotary (tables
    narrower than half a head): the dims past the rotated ones are the normalized values
    themselves, off by the norm's bound alone."""
    if weight is None:
        normed, d = x.double(), torch.zeros_like(x, dtype=torch.float64)
    else:
        norm = rms_norm_zero_centered if zero_centered else rms_norm
        stored = norm(x, weight, 1e-6)
        d = rms_norm_bound(x, weight, stored, dim, dtype, ulps, zero_centered)
        normed = stored.double()
    half = cos.shape[-1]
    rot = 2 * half
    x1, x2, d1, d2 = normed[..., :half], normed[..., half:rot], d[..., :half], d[..., half:rot]
    c, s = cos.double(), sin.double()

    def product(d: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return rounded(d, value, dtype, ulps)

    x1c, x2s = product(c.abs() * d1, x1 * c), product(s.abs() * d2, x2 * s)
    x2c, x1s = product(c.abs() * d2, x2 * c), product(s.abs() * d1, x1 * s)
    w = want.double()
    o1, o2 = product(x1c + x2s, w[..., :half]), product(x2c + x1s, w[..., half:rot])
    return torch.cat((o1, o2, d[..., rot:]), -1)


def check_qk_norm_rotary_in_place(
    kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    dtype: torch.dtype,
    dim: int,
    with_norm: bool,
    heads: tuple[int, int, int],
    seed: int,
    ulps: float = 1.0,
    zero_centered: bool = False,
    rotary_dim: int | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run a q/k norm + rotary ``kernel`` (the reference's signature) on q and k, views of
    one fused [tokens, (Hq + 2 Hk) D] projection (``heads``: tokens, Hq, Hk); assert that it
    wrote them in place, left v alone and kept within ``rotary_bound``. Returns the (got,
    want) pairs of q and k. With ``zero_centered`` or ``rotary_dim`` (Qwen3.5's gated
    attention: its norm, its partial rotary, weights near zero) the projection is the gated
    one, each query head followed by its output gate ([tokens, (2 Hq + 2 Hk) D]), and the
    gates must be left alone too."""
    tokens, q_heads, k_heads = heads
    gated = zero_centered or rotary_dim is not None
    rotated = dim if rotary_dim is None else rotary_dim
    q_width = (2 if gated else 1) * q_heads * dim
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, q_width + 2 * k_heads * dim, generator=g).to(dtype)
    q, k, _ = torch.split(qkv, [q_width, k_heads * dim, k_heads * dim], dim=-1)
    q = q.view(tokens, q_heads, 2 * dim)[..., :dim] if gated else q.view(tokens, q_heads, dim)
    k = k.view(tokens, k_heads, dim)
    freqs = torch.outer(torch.arange(512).float(), torch.rand(rotated // 2, generator=g))
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    positions = torch.randint(0, 512, (tokens,), generator=g)
    offset = 0.0 if zero_centered else 1.0
    weights = [(offset + 0.1 * torch.randn(dim, generator=g)).to(dtype) for _ in range(2)]
    qw, kw = weights if with_norm else (None, None)
    extra = (zero_centered, rotary_dim) if gated else ()
    want_q, want_k = qk_norm_rotary(q.clone(), k.clone(), qw, kw, 1e-6, cos, sin, positions, *extra)
    # Everything but q and k: v, and the gates beside the queries.
    untouched = torch.ones(qkv.shape, dtype=torch.bool)
    untouched[:, q_width : q_width + k_heads * dim] = False
    if gated:
        untouched[:, :q_width].view(tokens, q_heads, 2 * dim)[..., :dim] = False
    else:
        untouched[:, :q_width] = False
    others = qkv[untouched].clone()
    inputs = q.clone(), k.clone()
    got_q, got_k = kernel(q, k, qw, kw, 1e-6, cos, sin, positions, *extra)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr(), "in place"
    assert torch.equal(qkv[untouched], others), "v (and the gates) left alone"
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    pairs = [(got_q, want_q), (got_k, want_k)]
    for x, w, (got, want) in zip(inputs, (qw, kw), pairs, strict=True):
        bound = rotary_bound(x, w, c, s, want, dim, dtype, ulps, zero_centered)
        within(got, want, bound)
    return pairs
