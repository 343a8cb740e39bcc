"""RMSNorm and its variants as one Triton row kernel: a program per row, the row in one tile.

The variants differ only in where they round, and each rounds where its torch reference does
(``reference/elementwise.py``), so the two agree to the float32 reduction order: plain RMSNorm
rounds the normalised row to the input dtype before the weight; the zero-centred one scales
by ``1 + weight`` in float32 and rounds once; the gated one rounds like plain RMSNorm, then
multiplies by ``silu(gate)`` in float32. Every sum and product is taken in float32 (Triton's
interpreter cannot add bfloat16, and on a device the float32 path is what the reference does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PLAIN, GATED, ZERO_CENTERED = 0, 1, 2


@triton.jit
def _rms_norm_rows(
    x_ptr,
    residual_ptr,
    gate_ptr,
    weight_ptr,
    out_ptr,
    x_stride,
    residual_stride,
    gate_stride,
    out_stride,
    n_cols,
    eps,
    VARIANT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    h = x.to(tl.float32)
    if HAS_RESIDUAL:
        # The new running sum, rounded to the input dtype as torch's add rounds it, goes back
        # into the residual the caller handed over.
        r = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        x = (h + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_ptr + row * residual_stride + cols, x, mask=mask)
        h = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if VARIANT == 2:
        y = h * inv * (1.0 + w)
    else:
        y = (h * inv).to(x.dtype).to(tl.float32) * w
        if VARIANT == 1:
            g = tl.load(gate_ptr + row * gate_stride + cols, mask=mask, other=0.0).to(tl.float32)
            y = y.to(x.dtype).to(tl.float32) * (g / (1.0 + tl.exp(-g)))
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [rows, cols] with unit column stride (a view where it already is one)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    variant: int,
    residual: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    res = rows if residual is None else residual.view(rows.shape)
    gates = rows if gate is None else _rows(gate)
    n = rows.shape[1]
    _rms_norm_rows[(rows.shape[0],)](
        rows,
        res,
        gates,
        weight,
        out,
        rows.stride(0),
        res.stride(0),
        gates.stride(0),
        out.stride(0),
        n,
        eps,
        VARIANT=variant,
        HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(n),
    )
    return out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, weight, eps, PLAIN)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum written into ``residual`` (contiguous,
    the caller's running sum, handed over)."""
    if not residual.is_contiguous():
        residual = residual.contiguous()
    return _launch(x, weight, eps, PLAIN, residual=residual), residual


def rms_norm_gated(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    return _launch(x, weight, eps, GATED, gate=gate)


def rms_norm_zero_centered(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, weight, eps, ZERO_CENTERED)


def add_rms_norm_zero_centered(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm`` with the zero-centred norm."""
    if not residual.is_contiguous():
        residual = residual.contiguous()
    return _launch(x, weight, eps, ZERO_CENTERED, residual=residual), residual
