"""Decode attention over the paged KV cache in Triton, reading each sequence's K/V through its
block table in place (nothing is gathered out of the cache).

A program per (query token, query head): the query is scaled once, the context is walked in
tiles of ``TILE`` positions (a tile may span cache blocks: each position finds its block
through the table), with the online softmax of flash attention (running max, running sum,
the accumulator rescaled when the max grows). GQA maps query head ``h`` to KV head
``h // (num_heads // num_kv_heads)``. Scores, softmax and the weighted sum are float32
whatever the cache dtype; the output is rounded once. Only loads, stores, elementwise math and
reductions: the subset triton-ascend compiles, and no ``tl.dot`` (a decode query is one row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.core.kernels.attention_metadata import AttentionGroup

TILE = 64


@triton.jit
def cache_tile(
    table,
    start,
    kv_len,
    kv_head,
    d,
    d_mask,
    cache_block_stride,
    cache_slot_stride,
    cache_head_stride,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
):
    """Positions ``start ..`` (``TILE`` of them) of a sequence whose block table row is
    ``table``: (the positions, which lie before ``kv_len``, their [TILE, D] offsets into
    either cache for ``kv_head``, and the mask of those offsets)."""
    pos = start + tl.arange(0, TILE)
    p_mask = pos < kv_len
    block = tl.load(table + pos // BLOCK_SIZE, mask=p_mask, other=0)
    rows = block * cache_block_stride + (pos % BLOCK_SIZE) * cache_slot_stride
    offsets = rows[:, None] + kv_head * cache_head_stride + d[None, :]
    return pos, p_mask, offsets, p_mask[:, None] & d_mask[None, :]


@triton.jit
def _paged_decode(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    tables_ptr,
    table_row_ptr,
    kv_lens_ptr,
    scale,
    q_token_stride,
    q_head_stride,
    out_token_stride,
    out_head_stride,
    cache_block_stride,
    cache_slot_stride,
    cache_head_stride,
    table_stride,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + token * q_token_stride + head * q_head_stride + d, mask=d_mask, other=0.0)
    q = q.to(tl.float32) * scale
    kv_len = tl.load(kv_lens_ptr + token)
    table = tables_ptr + tl.load(table_row_ptr + token) * table_stride
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, kv_len, TILE):
        _, p_mask, offsets, mask = cache_tile(
            table, start, kv_len, kv_head, d, d_mask,
            cache_block_stride, cache_slot_stride, cache_head_stride, BLOCK_SIZE, TILE,
        )  # fmt: skip
        k = tl.load(k_cache_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        s = tl.where(p_mask, tl.sum(k * q[None, :], axis=1), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_cache_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(
        out_ptr + token * out_token_stride + head * out_head_stride + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


def read_in_place(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``q`` with unit stride along the head dimension (itself where it has one: a view of
    a wider projection is read in place), and the strides the paged kernels take in this
    order: q's token and head strides, out's, the caches' block, slot and head strides."""
    if v_cache.stride() != k_cache.stride():
        raise ValueError("the K and V caches must share a layout (the kernel reads both alike)")
    if out.stride(2) != 1:
        raise ValueError("out must have unit stride along the head dimension")
    if q.stride(2) != 1:
        q = q.contiguous()
    strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3])
    return q, strides


def paged_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """The decode group kernel: ``q``/``out`` [N, H, D]; the caches [blocks, block_size,
    Hkv, D] already hold this step's K/V (the layer wrote them)."""
    assert group.kv_lens is not None and group.table_row is not None
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_tokens == 0:
        return out
    q, strides = read_in_place(q, k_cache, v_cache, out)
    tables = group.gather_blocks
    _paged_decode[(num_tokens, num_heads)](
        q,
        k_cache,
        v_cache,
        out,
        tables,
        group.table_row,
        group.kv_lens,
        scale,
        *strides,
        tables.stride(0),
        GROUP=num_heads // num_kv_heads,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        TILE=TILE,
    )
    return out
