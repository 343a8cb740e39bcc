"""Rotary position embedding (rotate-half) in Triton, alone and fused after Qwen3's per-head
q/k RMSNorm: a program per (token, tile of heads), each head's two halves loaded as
[heads, D / 2] tiles, so the norm's sum of squares is a row reduction and the rotation pairs
element i with element i + D / 2 without a shuffle.

Roundings are the reference's (``reference/elementwise.py``), op by op: torch rounds each
product ``x1 * cos``, ``x2 * sin`` to the tensor dtype and then the sum or difference, so the
kernel widens on load, multiplies in float32 (exact for float16 and bfloat16 operands),
rounds each product, and rounds the difference once more (a float32 subtraction rounded to
the dtype, as torch computes it). The norm is ``rms_norm``'s: normalise in float32, round,
multiply by the weight, round; or Qwen3.5's zero-centred one: normalise and scale by
``1 + weight`` in float32, round once. With partial rotary (Qwen3.5's) only the first
``rotary_dim`` dims rotate; the rest of each head, a third tile, is normalised and stored.

``rotary`` returns a new tensor, as the reference: its caller (``RotaryEmbedding.rotate``,
with partial rotary a view of the first dims) keeps no promise that its input may be
overwritten. ``qk_norm_rotary`` rewrites ``q`` and ``k`` in place, as the CPU kernel does
(``cpu/elementwise.py``): its callers (``models/decoder.py``, ``layers/gated_attention.py``)
hand over views of the fresh qkv projection that nothing else reads (v and the gates lie in
other columns) and use only the returned tensors, so the two new [T, H, D] allocations the
reference makes are saved; each program reads its whole tile before it writes it, and no two
programs share an element.
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
    rest,
    eps,
    HAS_WEIGHT: tl.constexpr,
    CENTERED: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_REST: tl.constexpr,
):
    # Each head: 2 half rotated elements, then ``rest`` that partial rotary passes through
    # (BLOCK_REST 0 where the whole head rotates).
    token = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < half
    head_mask = (heads < num_heads)[:, None]
    mask = head_mask & col_mask[None, :]
    x_heads = x_ptr + token * x_token_stride + heads[:, None] * x_head_stride
    out_heads = out_ptr + token * out_token_stride + heads[:, None] * out_head_stride
    src, dst = x_heads + cols[None, :], out_heads + cols[None, :]
    dtype = out_ptr.dtype.element_ty
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    if BLOCK_REST > 0:
        rest_cols = tl.arange(0, BLOCK_REST)
        rest_col_mask = rest_cols < rest
        rest_mask = head_mask & rest_col_mask[None, :]
        rest_offsets = 2 * half + rest_cols[None, :]
        xr = tl.load(x_heads + rest_offsets, mask=rest_mask, other=0.0)
        xr = xr.to(tl.float32)
    if HAS_WEIGHT:
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        if BLOCK_REST > 0:
            ss += tl.sum(xr * xr, axis=1)
        inv = (1.0 / tl.sqrt(ss / (2 * half + rest) + eps))[:, None]
        w1 = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(weight_ptr + half + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if CENTERED:
            # Zero-centred: round(x inv (1 + w)), one rounding as the reference's.
            x1 = (x1 * inv * (1.0 + w1)).to(dtype).to(tl.float32)
            x2 = (x2 * inv * (1.0 + w2)).to(dtype).to(tl.float32)
        else:
            x1 = ((x1 * inv).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
            x2 = ((x2 * inv).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
        if BLOCK_REST > 0:
            wr = tl.load(weight_ptr + 2 * half + rest_cols, mask=rest_col_mask, other=0.0)
            wr = wr.to(tl.float32)[None, :]
            if CENTERED:
                xr = xr * inv * (1.0 + wr)
            else:
                xr = (xr * inv).to(dtype).to(tl.float32)
                xr = xr * wr
    if BLOCK_REST > 0:
        tl.store(out_heads + rest_offsets, xr.to(dtype), mask=rest_mask)
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
    zero_centered: bool = False,
) -> None:
    """Rotate the first ``2 cos.shape[1]`` dims of ``x`` [T, H, D] (unit stride along D) into
    ``out`` (the rest copied, normalised where ``weight`` is given), with table rows
    ``positions[t]`` (or row t) of ``cos``/``sin`` [rows, rotated / 2]."""
    tokens, num_heads, dim = x.shape
    if tokens == 0 or num_heads == 0:
        return
    half = cos.shape[1]
    rest = dim - 2 * half
    block_half = triton.next_power_of_2(half)
    block_rest = triton.next_power_of_2(rest) if rest > 0 else 0
    widest = max(block_half, block_rest)
    block_h = min(triton.next_power_of_2(num_heads), max(1, TILE // widest))
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
        rest,
        eps,
        HAS_WEIGHT=weight is not None,
        CENTERED=zero_centered,
        HAS_POSITIONS=positions is not None,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        BLOCK_REST=block_rest,
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
    zero_centered: bool = False,
    rotary_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` [T, Hq, D], ``k`` [T, Hk, D] normalised per head (where both weights are given;
    ``zero_centered``: Qwen3.5's norm) and their first ``rotary_dim`` (default D) rotated at
    ``positions`` through the [max_position, rotary_dim / 2] tables, in place (in a copy,
    returned, where a head's elements are not adjacent). Tables and weights in another dtype
    than q and k make torch promote the results: the reference serves them."""
    norm = q_weight is not None and k_weight is not None
    others = (k, cos, sin, *((q_weight, k_weight) if norm else ()))
    if any(t is not None and t.dtype != q.dtype for t in others):
        return reference.qk_norm_rotary(
            q, k, q_weight, k_weight, eps, cos, sin, positions, zero_centered, rotary_dim
        )
    if 2 * cos.shape[-1] != (q.shape[-1] if rotary_dim is None else rotary_dim):
        raise ValueError(f"tables of {cos.shape[-1]} columns do not rotate {rotary_dim} dims")
    q, k = _unit_last(q), _unit_last(k)
    tables, index = _tables(cos, sin), positions.contiguous()
    _launch(q, q, *tables, index, q_weight if norm else None, eps, zero_centered)
    _launch(k, k, *tables, index, k_weight if norm else None, eps, zero_centered)
    return q, k
