"""The routed experts in Triton: each projection ONE grouped GEMM launch over every active
expert, with routing that never waits on the host.

Routing, all on the device in tensors: the (token, choice) pairs are sorted by expert
(stable, so a token's rows follow expert order as in the reference), the per-expert row
offsets [E + 1] come from ``searchsorted`` over the sorted ids (``bincount`` would serve,
but on CUDA it reads the largest id back to the host to size its output), and each expert's
rows are cut into row tiles of ``BLOCK_M``. The launch grid cannot depend on how the rows
fall, so it is sized from shapes alone: ``cdiv(N, BLOCK_M) + min(E, N)`` row tiles bound
``sum_e cdiv(n_e, BLOCK_M)`` for N = T k rows; a program per (row tile, column tile) reads
which expert its tile belongs to (a ``searchsorted`` of the tile number in the per-expert
tile offsets), finds its rows from the row offsets tensor, and returns at once when it lies
past the last active expert's tiles. Experts with no rows own no tiles.

One grouped-GEMM kernel serves both launches. The first multiplies the token rows (gathered
through the sorted order, not copied) by the expert's gate and up rows, two float32
accumulators per tile, and applies the gated activation in its epilogue, so only [N, I] is
written; the second multiplies those rows by the down projection into [N, H] rows in sorted
order; a third kernel adds each token's k rows, scaled
by their routing weights, back to the token. ``tl.dot`` takes float16 tiles as they are and
float32 tiles (bfloat16 widened to float32 first: exact, and the subset triton-ascend
compiles) with IEEE products (on CUDA, TF32 for widened bfloat16, whose 8-bit significands
TF32 holds exactly), accumulating in float32.

Roundings are those of the reference (``reference/fused_moe.py``): each GEMM's float32 sum
is rounded to the data dtype (as torch's float16/bfloat16 GEMMs round their float32
accumulation), the activation rounds as ``reference.elementwise``'s gated activations do,
the routing weight is rounded to the data dtype and its product with the row rounded, and a
token's rows are added in the order ``index_add_`` adds them (expert order), rounding after
each addition. The result is this rank's partial sum (the caller all-reduces).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.core.kernels.triton.activation import ACTIVATIONS, apply_activation

BLOCK_N = 64
BLOCK_K = 32
# Columns of H one program of the combine adds up.
COMBINE_BLOCK = 1024


@triton.jit
def _grouped_gemm(
    a_ptr,
    w_ptr,
    out_ptr,
    tile_expert_ptr,
    tile_offsets_ptr,
    offsets_ptr,
    num_experts,
    k_dim,
    n_dim,
    a_stride,
    w_expert_stride,
    w_row_stride,
    out_stride,
    token_ptr,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One (row tile, column tile) of ``out = a @ w[e]^T`` for the expert ``e`` whose rows
    the tile covers. GATED: ``a`` is the token rows (row r reads token ``token[r]``), ``w``
    holds the gate rows then the up rows (``n_dim`` each), and the tile stores
    ``act(gate) * up``; otherwise ``a`` is in sorted-row order already."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert >= num_experts:
        return
    start = tl.load(offsets_ptr + expert) + (tile - tl.load(tile_offsets_ptr + expert)) * BLOCK_M
    rows = start + tl.arange(0, BLOCK_M)
    row_mask = rows < tl.load(offsets_ptr + expert + 1)
    a_rows = rows
    if GATED:
        a_rows = tl.load(token_ptr + rows, mask=row_mask, other=0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_dim
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * a_stride + ks[None, :]
    # [BLOCK_K, BLOCK_N] views of the expert's weight rows (and of the up rows n_dim on).
    w_ptrs = w_ptr + expert * w_expert_stride + cols[None, :] * w_row_stride + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        k_mask = (k0 + ks) < k_dim
        a = tl.load(a_ptrs + k0, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        a = a.to(DOT_DTYPE)
        w_mask = k_mask[:, None] & col_mask[None, :]
        w = tl.load(w_ptrs + k0, mask=w_mask, other=0.0).to(DOT_DTYPE)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if GATED:
            up = tl.load(w_ptrs + n_dim * w_row_stride + k0, mask=w_mask, other=0.0)
            acc_up = tl.dot(a, up.to(DOT_DTYPE), acc_up, input_precision=PRECISION)
    dtype = out_ptr.dtype.element_ty
    result = acc
    if GATED:
        gate = acc.to(dtype).to(tl.float32)
        act = apply_activation(gate, ACTIVATION).to(dtype).to(tl.float32)
        result = act * acc_up.to(dtype).to(tl.float32)
    out = out_ptr + rows[:, None] * out_stride + cols[None, :]
    tl.store(out, result.to(dtype), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _combine(
    rows_ptr,
    positions_ptr,
    choices_ptr,
    weights_ptr,
    out_ptr,
    hidden,
    num_choices,
    rows_stride,
    weights_stride,
    out_stride,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(num_choices):
        # The token's rows in sorted (expert) order, as index_add_ adds them.
        pos = tl.load(positions_ptr + token * num_choices + j)
        choice = tl.load(choices_ptr + token * num_choices + j)
        w = tl.load(weights_ptr + token * weights_stride + choice).to(dtype).to(tl.float32)
        row = tl.load(rows_ptr + pos * rows_stride + cols, mask=mask, other=0.0).to(tl.float32)
        acc = (acc + (row * w).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * out_stride + cols, acc.to(dtype), mask=mask)


def _dot_types(x: torch.Tensor) -> tuple[tl.dtype, str]:
    """The dtype the tiles are multiplied in, and the float32 product precision: IEEE
    (the one precision every backend accepts; Ascend's others are its own) except for
    bfloat16 widened on CUDA, whose products TF32 computes exactly on the tensor cores."""
    if x.dtype is torch.float16:
        return tl.float16, "ieee"
    exact_tf32 = x.dtype is torch.bfloat16 and x.device.type == "cuda"
    return tl.float32, "tf32" if exact_tf32 else "ieee"


def _grouped(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    routing: tuple[torch.Tensor, ...],
    **constants: object,
) -> None:
    """One grouped-GEMM launch of ``a`` [rows, K] by the experts' ``w`` [E, N (x 2 where
    gated), K] into ``out`` [rows, N]: a program per (row tile, column tile)."""
    tile_expert, tile_offsets, offsets, token = routing
    grid = (tile_expert.shape[0], triton.cdiv(out.shape[1], BLOCK_N))
    _grouped_gemm[grid](
        a, w, out, tile_expert, tile_offsets, offsets, w.shape[0], a.shape[1], out.shape[1],
        a.stride(0), w.stride(0), w.stride(1), out.stride(0), token, BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K, **constants,
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """``x`` [T, H], ``w13`` [E, 2 I, H], ``w2`` [E, H, I], ``topk_weights``/``topk_ids``
    [T, k] -> [T, H]: sum over each token's k experts of weight * down(act(gate(x)) *
    up(x)), this rank's partial sums."""
    act = ACTIVATIONS[activation]
    tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    num_choices = topk_ids.shape[1]
    n = tokens * num_choices
    device = x.device
    out = torch.empty_like(x)
    if n == 0 or hidden == 0 or inter == 0:
        return out.zero_()
    x = x if x.stride(1) == 1 else x.contiguous()
    w13 = w13 if w13.stride(2) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(2) == 1 else w2.contiguous()
    block_m = 16 if n <= 16 * num_experts else 64

    # Routing, in device tensors only (nothing here reads a value back to the host).
    flat = topk_ids.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    bounds = torch.arange(num_experts + 1, device=device, dtype=flat.dtype)
    offsets = torch.searchsorted(sorted_ids, bounds)
    expert_tiles = (offsets[1:] - offsets[:-1] + (block_m - 1)) // block_m
    tile_offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    torch.cumsum(expert_tiles, 0, out=tile_offsets[1:])
    max_tiles = triton.cdiv(n, block_m) + min(num_experts, n)
    tile_ids = torch.arange(max_tiles, device=device, dtype=torch.int64)
    tile_expert = torch.searchsorted(tile_offsets[1:], tile_ids, right=True)
    token = order // num_choices
    # Each token's rows in sorted order, ascending: the inverse permutation per token.
    rank = torch.arange(n, device=device, dtype=order.dtype)
    inverse = torch.empty_like(order).scatter_(0, order, rank)
    positions, choices = inverse.view(tokens, num_choices).sort(dim=1)

    dot_dtype, precision = _dot_types(x)
    tiling = {"DOT_DTYPE": dot_dtype, "PRECISION": precision, "BLOCK_M": block_m}
    routing = (tile_expert, tile_offsets, offsets, token)
    hidden_rows = torch.empty(n, inter, dtype=x.dtype, device=device)
    _grouped(x, w13, hidden_rows, routing, ACTIVATION=act, GATED=True, **tiling)
    expert_rows = torch.empty(n, hidden, dtype=x.dtype, device=device)
    _grouped(hidden_rows, w2, expert_rows, routing, ACTIVATION=act, GATED=False, **tiling)
    block = min(COMBINE_BLOCK, triton.next_power_of_2(hidden))
    weights = topk_weights if topk_weights.stride(1) == 1 else topk_weights.contiguous()
    _combine[(tokens, triton.cdiv(hidden, block))](
        expert_rows,
        positions,
        choices,
        weights,
        out,
        hidden,
        num_choices,
        expert_rows.stride(0),
        weights.stride(0),
        out.stride(0),
        BLOCK=block,
    )
    return out
