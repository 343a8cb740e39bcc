"""Prefill attention over the paged KV cache in Triton: each chunk attends causally its
sequence's cached tokens and its own, all read from the cache in place through the block table
(the layer has already written the chunk's K/V there; nothing is gathered out of the cache).

Flash attention's tiling. A program takes one query tile of one sequence for one KV head: the
query heads sharing that KV head are packed into the tile's rows (row ``r`` is token
``r // GROUP`` of the tile, query head ``kv_head * GROUP + r % GROUP``), so each K/V tile read
from the cache serves the whole GQA group. The keys are walked in tiles of ``BLOCK_N``
positions (a tile may span cache blocks: each position finds its block through the table) with
the online softmax (running max and sum per row, the accumulator rescaled when the max grows).

The query at index ``i`` of a chunk of ``Q`` tokens of a sequence of ``L`` tokens sits at
absolute position ``L - Q + i`` and sees keys ``0 .. L - Q + i``. Every key before the tile's
first query position is seen by every row of the tile, so those key tiles take no mask at all;
only the tiles from there to the tile's last query (the diagonal, at most
``BLOCK_Q / BLOCK_N + 1`` of them) mask ahead of each row and past the sequence's end.

The programs cover the group's tiles laid end to end (sequence by sequence), and each finds
its sequence by counting the tiles of those before it: the grid is sized from the group's token
count, known on the host, so the launch reads nothing back from the device. The few programs
past the last tile (the count is an upper bound) run empty loops and store nothing.

Numerics: float32 throughout whatever the cache dtype; the output is rounded once. Scores are
``tl.dot`` of the query tile with the key tile: in the input dtype on float16 and bfloat16
inputs (the products of two such values are exact in float32 and accumulate in float32),
otherwise in float32. The softmax weights keep float32's precision for the weighted sum of V,
not rounded to the input dtype as many flash kernels do: on float16 and bfloat16 inputs each
weight is split into parts in that dtype (the weight rounded, then the rest rounded, and so
on: three bfloat16 parts carry 24 significant bits, two float16 ones 22, down to float16's
subnormal step of 2^-24), each part times V exact in float32, so the matrix units do the sum
with float32 accumulation. Float32 inputs take float32 ``tl.dot`` at IEEE precision (CUDA
would otherwise take TF32's 10-bit mantissas). Triton's interpreter cannot multiply bfloat16:
there bfloat16 operands (the query, the keys, the parts of the weights, V) are widened first,
with the same products.

Tiles and warps. A float32 ``tl.dot`` runs as FMAs on a GPU with its operand tiles in
registers, which is why the float32 kernel takes 32-query, 16-key tiles in eight warps for
heads wider than 64: the 64x32 tiles overflow the registers there. So did every dtype's before
the weights were split (all took FMA dots then): at head size 128 ptxas spilled about 30 KB
per thread, and on an H200 bfloat16 ran eight times slower than at head size 64. The
tensor-core dots hold 64x32 tiles in four warps without a spill up to head size 128 (ptxas
for sm_90a, Triton 3.6); 256-wide heads take 32x16 tiles.

Only loads, stores, elementwise math, reductions, loops with runtime bounds and ``tl.dot`` on
tiles of at least 16x16: the subset triton-ascend compiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.core.kernels.attention_metadata import AttentionGroup
from tandem.core.kernels.triton.paged_attention import cache_tile, read_in_place


@triton.jit
def _attend_tile(
    q,
    k_cache_ptr,
    v_cache_ptr,
    table,
    start,
    kv_head,
    q_pos,
    kv_len,
    acc,
    m_i,
    l_i,
    scale,
    cache_block_stride,
    cache_slot_stride,
    cache_head_stride,
    d,
    d_mask,
    MASKED: tl.constexpr,
    DOT_NATIVE: tl.constexpr,
    PV_PARTS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One key tile into the running softmax of a query tile: (acc, m_i, l_i) updated."""
    pos, p_mask, offsets, mask = cache_tile(
        table, start, kv_len, kv_head, d, d_mask,
        cache_block_stride, cache_slot_stride, cache_head_stride, BLOCK_SIZE, BLOCK_N,
    )  # fmt: skip
    k = tl.load(k_cache_ptr + offsets, mask=mask, other=0.0)
    if DOT_NATIVE:
        s = tl.dot(q, tl.trans(k), out_dtype=tl.float32)
    else:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    s = s * scale
    if MASKED:
        seen = (pos[None, :] <= q_pos[:, None]) & p_mask[None, :]
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    v = tl.load(v_cache_ptr + offsets, mask=mask, other=0.0)
    acc = acc * alpha[:, None]
    if PV_PARTS == 0:
        acc += tl.dot(p, v, input_precision="ieee")
    else:
        # The weights as a sum of parts in V's dtype (module docstring): each part times V is
        # exact in float32, so the matrix units keep float32's weights.
        rest = p
        for _ in tl.static_range(PV_PARTS):
            part = rest.to(v.dtype)
            if DOT_NATIVE:
                acc = tl.dot(part, v, acc, out_dtype=tl.float32)
            else:
                acc += tl.dot(part.to(tl.float32), v.to(tl.float32), input_precision="ieee")
            rest -= part.to(tl.float32)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return acc, m_new, l_i


@triton.jit
def _paged_prefill(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    tables_ptr,
    q_starts_ptr,
    q_lens_ptr,
    kv_lens_ptr,
    num_seqs,
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
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_NATIVE: tl.constexpr,
    PV_PARTS: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    # This tile's sequence: the number of sequences whose tiles all lie before it.
    seq = 0
    first_tile = 0
    seen_tiles = 0
    for b in range(0, num_seqs):
        n = ((tl.load(q_lens_ptr + b) + BLOCK_Q - 1) // BLOCK_Q).to(tl.int32)
        before = seen_tiles + n <= tile
        seq += before.to(tl.int32)
        first_tile += tl.where(before, n, 0)
        seen_tiles += n
    live = seq < num_seqs
    seq = tl.minimum(seq, num_seqs - 1)
    q_len = tl.where(live, tl.load(q_lens_ptr + seq), 0)
    kv_len = tl.load(kv_lens_ptr + seq)
    q0 = (tile - first_tile) * BLOCK_Q  # the tile's first query within its chunk
    ctx = kv_len - tl.load(q_lens_ptr + seq)  # cached tokens before the chunk

    r = tl.arange(0, BLOCK_M)
    i = q0 + r // GROUP
    row_mask = (r < BLOCK_Q * GROUP) & (i < q_len)
    head = kv_head * GROUP + r % GROUP
    token = tl.load(q_starts_ptr + seq) + i
    q_pos = ctx + i
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    io_mask = row_mask[:, None] & d_mask[None, :]
    q_offsets = token[:, None] * q_token_stride + head[:, None] * q_head_stride + d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=io_mask, other=0.0)
    if not DOT_NATIVE:
        q = q.to(tl.float32)
    table = tables_ptr + seq * table_stride

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys every row sees (those up to the tile's first query), in whole tiles: no mask. A
    # dead program (past the last tile) has q_len 0 and so runs no iteration.
    open_end = tl.where(live, (ctx + q0 + 1) // BLOCK_N * BLOCK_N, 0)
    for start in range(0, open_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, k_cache_ptr, v_cache_ptr, table, start, kv_head, q_pos, kv_len, acc, m_i, l_i,
            scale, cache_block_stride, cache_slot_stride, cache_head_stride, d, d_mask,
            False, DOT_NATIVE, PV_PARTS, BLOCK_SIZE, BLOCK_N,
        )  # fmt: skip
    # The diagonal: keys up to the tile's last query, masked ahead of each row.
    diag_end = tl.where(live, tl.minimum(kv_len, ctx + q0 + BLOCK_Q), 0)
    for start in range(open_end, diag_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, k_cache_ptr, v_cache_ptr, table, start, kv_head, q_pos, kv_len, acc, m_i, l_i,
            scale, cache_block_stride, cache_slot_stride, cache_head_stride, d, d_mask,
            True, DOT_NATIVE, PV_PARTS, BLOCK_SIZE, BLOCK_N,
        )  # fmt: skip
    # Rows of a dead program never met a key (their sum is 0); they are not stored.
    out = acc / tl.where(row_mask, l_i, 1.0)[:, None]
    out_offsets = token[:, None] * out_token_stride + head[:, None] * out_head_stride + d[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def _tiles(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M query rows, BLOCK_N keys, warps) per program (module docstring)."""
    if dtype == torch.float32 and head_dim > 64:
        return 32, 16, 8
    return (64, 32, 4) if head_dim <= 128 else (32, 16, 4)


def _dots(q: torch.Tensor) -> tuple[bool, int]:
    """(whether the ``tl.dot``s multiply in q's own dtype, the parts the weights are split
    into for the weighted sum of V: 0 to keep them float32) for q's dtype."""
    # An interpreted kernel is not a JITFunction, and cannot multiply bfloat16.
    compiled = isinstance(_paged_prefill, triton.runtime.JITFunction)
    if q.dtype == torch.float16:
        return True, 2
    if q.dtype == torch.bfloat16:
        return compiled, 3
    return False, 0


def paged_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """The prefill group kernel: ``q``/``out`` [N, H, D], sequence ``b``'s chunk in rows
    ``seq_query_start[b] ..`` of them; the caches [blocks, block_size, Hkv, D] already hold
    the chunks' K/V (the layer wrote them)."""
    assert group.seq_query_start is not None and group.seq_query_len is not None
    assert group.seq_kv_len is not None
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_tokens == 0:
        return out
    q, strides = read_in_place(q, k_cache, v_cache, out)
    group_size = num_heads // num_kv_heads
    block_m, block_n, num_warps = _tiles(head_dim, q.dtype)
    block_m = max(block_m, triton.next_power_of_2(group_size))
    block_q = block_m // group_size
    tables = group.gather_blocks
    num_seqs = tables.shape[0]
    # Each sequence's tiles: ceil(len / block_q) <= (len + block_q - 1) / block_q; summed.
    max_tiles = (num_tokens + num_seqs * (block_q - 1)) // block_q
    dot_native, pv_parts = _dots(q)
    _paged_prefill[(max_tiles, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        tables,
        group.seq_query_start,
        group.seq_query_len,
        group.seq_kv_len,
        num_seqs,
        scale,
        *strides,
        tables.stride(0),
        GROUP=group_size,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        DOT_NATIVE=dot_native,
        PV_PARTS=pv_parts,
        num_warps=num_warps,
    )
    return out
