"""Rotary position embedding (rotate-half) in Triton, alone and fused after Qwen3's per-head
q/k RMSNorm: a program per (token, tile of heads), each head's two halves loaded as
[heads, D / 2] tiles, so the norm's sum of squares is a row reduction and the rotation pairs
element i with element i + D / 2 without a shuffle.

Roundings are the reference's (``reference/elementwise.py``), op by op: torch rounds each
product ``x1 * cos``, ``x2 * sin`` to the tensor dtype and then the sum or difference, so the
kernel widens on load, multiplies in float32 (exact for float16 and bfloat16 operands),
rounds each product, and rounds the difference once more (a float32 subtraction rounded to
the dtype, as torch computes it). The norm is ``rms_norm``'s: normalise in float32, round,
multiply by the weight, round.

``rotary`` returns a new tensor, as the reference: its caller (``RotaryEmbedding.rotate``,
with partial rotary a view of the first dims) keeps no promise that its input may be
overwritten. ``qk_norm_rotary`` rewrites ``q`` and ``k`` in place, as the CPU kernel does
(``cpu/elementwise.py``): its one caller (``models/decoder.py``) hands over views of the
fresh qkv projection that nothing else reads (v lies in other columns) and uses only the
returned tensors, so the two new [T, H, D] allocations the reference makes are saved; each
program reads its whole tile before it writes it, and no two programs share an element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.core.kernels.reference import elementwise as reference

# Elements of a [heads, D / 2] tile a program takes.
TILE = 2048


@triton.jit
def _rotary_heads(
    x_ptr,
    out_ptr,
    weight_ptr,
    cos_ptr,
    sin_ptr,
    positions_ptr,
    x_token_stride,
    x_head_stride,
    out_token_stride,
    out_head_stride,
    cos_token_stride,
    num_heads,
    half,
    eps,
    HAS_WEIGHT: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < half
    mask = (heads < num_heads)[:, None] & col_mask[None, :]
    src = x_ptr + token * x_token_stride + heads[:, None] * x_head_stride + cols[None, :]
    dtype = out_ptr.dtype.element_ty
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    if HAS_WEIGHT:
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        inv = (1.0 / tl.sqrt(ss / (2 * half) + eps))[:, None]
        w1 = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(weight_ptr + half + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        x1 = ((x1 * inv).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * inv).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    row = token
    if HAS_POSITIONS:
        row = tl.load(positions_ptr + token)
    c = tl.load(cos_ptr + row * cos_token_stride + cols, mask=col_mask, other=0.0)
    s = tl.load(sin_ptr + row * cos_token_stride + cols, mask=col_mask, other=0.0)
    c = c.to(tl.float32)[None, :]
    s = s.to(tl.float32)[None, :]
    a1 = (x1 * c).to(dtype).to(tl.float32)
    b1 = (x2 * s).to(dtype).to(tl.float32)
    a2 = (x2 * c).to(dtype).to(tl.float32)
    b2 = (x1 * s).to(dtype).to(tl.float32)
    dst = out_ptr + token * out_token_stride + heads[:, None] * out_head_stride + cols[None, :]
    tl.store(dst, (a1 - b1).to(dtype), mask=mask)
    tl.store(dst + half, (a2 + b2).to(dtype), mask=mask)


def _launch(
    x: torch.Tensor,
    out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> None:
    """Rotate ``x`` [T, H, D] (unit stride along D) into ``out``, with table rows
    ``positions[t]`` (or row t) of ``cos``/``sin`` [rows, D / 2]."""
    tokens, num_heads, dim = x.shape
    if tokens == 0 or num_heads == 0:
        return
    half = dim // 2
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(num_heads), max(1, TILE // block_half))
    grid = (tokens, triton.cdiv(num_heads, block_h))
    _rotary_heads[grid](
        x,
        out,
        x if weight is None else weight,
        cos,
        sin,
        cos if positions is None else positions,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        cos.stride(0),
        num_heads,
        half,
        eps,
        HAS_WEIGHT=weight is not None,
        HAS_POSITIONS=positions is not None,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
    )


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as [rows, D / 2] with unit column stride and one row stride."""
    c, s = (_unit_last(t.reshape(t.shape[0], t.shape[-1])) for t in (cos, sin))
    if c.stride() != s.stride():
        c, s = c.contiguous(), s.contiguous()
    return c, s


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of ``x`` [T, H, D] with cos/sin [T, 1, D/2], into a new
    tensor (of the dtype torch's promotion gives the reference)."""
    x = _unit_last(x)
    out_dtype = torch.promote_types(x.dtype, cos.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    _launch(x, out, *_tables(cos, sin), None)
    return out


def qk_norm_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` [T, Hq, D], ``k`` [T, Hk, D] normalised per head (where both weights are given)
    and rotated at ``positions`` through the [max_position, D/2] tables, in place (in a
    copy, returned, where a head's elements are not adjacent). Tables and weights in
    another dtype than q and k make torch promote the results: the reference serves them."""
    norm = q_weight is not None and k_weight is not None
    others = (k, cos, sin, *((q_weight, k_weight) if norm else ()))
    if any(t is not None and t.dtype != q.dtype for t in others):
        return reference.qk_norm_rotary(q, k, q_weight, k_weight, eps, cos, sin, positions)
    q, k = _unit_last(q), _unit_last(k)
    tables, index = _tables(cos, sin), positions.contiguous()
    _launch(q, q, *tables, index, q_weight if norm else None, eps)
    _launch(k, k, *tables, index, k_weight if norm else None, eps)
    return q, k
