"""The gated delta rule of Gated DeltaNet in Triton (``reference/gated_delta_rule.py`` states
the recurrence and the state pool ``[num_slots + 1, Hv, Dk, Dv]``): the one-token decode step
and the varlen prefill, each continuing every sequence's recurrent state in its slot.

Decode is one kernel: a program per (sequence, value head, tile of ``Dv``) loads its ``[Dk,
Dv-tile]`` slice of the state in float32, takes the one step (the decay, two reductions over
``Dk``: the state's prediction of ``v``, then the output; one rank-one update) and writes it
back. The value-dim tiles of a head are independent (each column of the state evolves on its
own given k, g and beta), so they are separate programs; each recomputes the head's L2 norms
of q and k, which is cheap beside the state.

Prefill is the chunked (WY / UT-transform) form of flash-linear-attention, in two kernels. A
token-by-token walk is serial in every token of a prompt, each step a rank-one update too
small to use the matrix units; in chunks of ``BT`` tokens all that depends only on the
chunk's own inputs is a few matrix products, computed for every chunk at once, and only the
hand-over of the state from one chunk to the next stays serial: ``BT`` times fewer serial
steps, each a handful of ``tl.dot``. With ``gc`` the cumulative log decay from the chunk's
start and ``S`` the state entering the chunk:

- ``_prepare_chunks``, a program per (sequence, chunk, value head), all chunks in parallel:
  ``A = strictly_lower(beta_i k_i.k_j exp(gc_i - gc_j))`` and ``T = (I + A)^-1`` as fla's
  ``solve_tril`` takes it: the inverses ``D`` of the diagonal blocks of 16 tokens by forward
  substitution (15 steps, the same row of every block at once, each a ``tl.dot`` of those rows
  with the tile), then, ``N = D A_off`` strictly lower by blocks (``N^4 = 0`` for ``BT <=
  64``), ``T = (I - N)(I + N^2) D``: four more products, no serial step over the chunk's
  ``BT`` rows. Then ``W = T (beta exp(gc) k)`` (the keys with which the chunk's tokens read
  the entering state), ``U = T (beta v)`` (their new values if the state were zero) and the
  causal intra-chunk attention ``Aqk = lower(q_i.k_j exp(gc_i - gc_j))``. W, U, Aqk and gc go
  to float32 buffers the wrapper allocates, one row per token.
- ``_walk_chunks``, a program per (sequence, value head, tile of ``Dv``): holds its state
  tile in float32 from the sequence's first chunk in this call to its last and, per chunk,
  ``V = U - W S`` (the values corrected by what the state already says), ``o = (q exp(gc)) S
  + Aqk V``, ``S = exp(gc_last) S + (k exp(gc_last - gc))^T V``.

Chunks never cross sequences: a sequence's chunks start at its first token and its last one
is partial, its missing rows masked (zero k, v, beta and g, so they neither read nor change
anything). ``BT`` is the module's ``CHUNK_SIZE`` (64, as fla) or, when every prompt of the
step is shorter, the metadata's shorter power of two, at least 16 (``tl.dot``'s least tile).
The chunk grid is (sequences, the longest's chunks): a short sequence's spare programs do
nothing.

Sequences without an initial state (a first chunk) start from zeros, whatever their slot
holds: the state is loaded masked, so not even NaN in the slot reaches them. Each program
reads and writes only its own state slice, in the same layout, so the update in place needs
no copy.

Rounding as the reference: q and k are L2-normalised in float32 (``x * rsqrt(sum x^2 +
1e-6)``, q then scaled by ``Dk^-1/2``); v, g and beta are widened to float32; the state, the
chunk algebra, W, U and the output are float32, every ``tl.dot`` at IEEE float32 precision
(not TF32, whose 10-bit mantissa would lose the 1e-4 the reference is matched to); the output
is rounded once to ``v``'s dtype and the state to the pool's. The kernels differ from the
reference only in the order of float32 sums and in inverting ``I + A`` by blocks where the
reference solves the triangular system for its right-hand sides (both stable: block forward
substitution; keys nearly parallel, beta near 1 and no decay, a hard case for the
system, stay within a few float32 ulps of a float64 token walk).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.core.kernels.linear_attention_metadata import LinearAttentionMetadata

EPS = 1e-6  # the L2 norm's, as reference.l2norm
VALUE_TILE = 32  # Dv columns of the state per program
# The prefill's float32 tl.dots run as FMAs on a GPU with their [BT, Dk] operand tiles in
# registers: with BT = Dk = 64 in four warps ptxas (sm_90a, Triton 3.6) spilled 54 KB per
# thread in _prepare_chunks and 11 KB in _walk_chunks; eight warps, and 16 state columns per
# walk, bring that to 2.6 KB and 0.6 KB. Neither changes a sum's order.
PREFILL_WARPS = 8
WALK_VALUE_TILE = 16
CHUNK_SIZE = 64  # tokens per chunk of the prefill (BT), at most
MIN_DOT = 16  # the least side of a tl.dot tile
SUB_CHUNK = 16  # tokens per diagonal block of the chunk's triangular inverse


@triton.jit
def _l2_normalised(ptr, d, mask, eps):
    """The vector ``ptr[d]`` widened to float32 and L2-normalised."""
    x = tl.load(ptr + d, mask=mask, other=0.0).to(tl.float32)
    return x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) + eps))


@triton.jit
def _l2_normalised_rows(ptrs, mask, eps):
    """The rows of the tile ``ptrs`` widened to float32 and L2-normalised."""
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return x * (1.0 / tl.sqrt(tl.sum(x * x, axis=1) + eps))[:, None]


@triton.jit
def _delta_rule_step(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    states_ptr,
    out_ptr,
    slots_ptr,
    has_initial_ptr,
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    v_token_stride,
    v_head_stride,
    g_token_stride,
    beta_token_stride,
    out_token_stride,
    out_head_stride,
    state_slot_stride,
    state_head_stride,
    state_key_stride,
    scale,
    eps,
    GROUP: tl.constexpr,
    KEY_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    VALUE_TILE: tl.constexpr,
    HAS_FRESH: tl.constexpr,
):
    t = tl.program_id(0)  # one token per sequence
    head = tl.program_id(1)
    key_head = head // GROUP
    dk = tl.arange(0, BLOCK_K)
    dk_mask = dk < KEY_DIM
    dv = tl.program_id(2) * VALUE_TILE + tl.arange(0, VALUE_TILE)
    dv_mask = dv < VALUE_DIM

    tile_mask = dk_mask[:, None] & dv_mask[None, :]
    if HAS_FRESH:
        # A where, not an &: Triton 3.9's interpreter cannot & a loaded bool into a block.
        tile_mask = tl.where(tl.load(has_initial_ptr + t), tile_mask, False)
    slot = tl.load(slots_ptr + t)
    state_ptrs = (
        states_ptr
        + slot * state_slot_stride
        + head * state_head_stride
        + dk[:, None] * state_key_stride
        + dv[None, :]
    )
    state = tl.load(state_ptrs, mask=tile_mask, other=0.0).to(tl.float32)
    q = _l2_normalised(q_ptr + t * q_token_stride + key_head * q_head_stride, dk, dk_mask, eps)
    q = q * scale
    k = _l2_normalised(k_ptr + t * k_token_stride + key_head * k_head_stride, dk, dk_mask, eps)
    v = tl.load(v_ptr + t * v_token_stride + head * v_head_stride + dv, mask=dv_mask, other=0.0)
    g = tl.load(g_ptr + t * g_token_stride + head).to(tl.float32)
    beta = tl.load(beta_ptr + t * beta_token_stride + head).to(tl.float32)
    state = state * tl.exp(g)
    predicted = tl.sum(k[:, None] * state, axis=0)  # [VALUE_TILE]: what S already says
    delta = (v.to(tl.float32) - predicted) * beta
    state = state + k[:, None] * delta[None, :]
    out = tl.sum(q[:, None] * state, axis=0)
    tl.store(
        out_ptr + t * out_token_stride + head * out_head_stride + dv,
        out.to(out_ptr.dtype.element_ty),
        mask=dv_mask,
    )
    tl.store(
        state_ptrs,
        state.to(states_ptr.dtype.element_ty),
        mask=dk_mask[:, None] & dv_mask[None, :],
    )


@triton.jit
def _prepare_chunks(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    starts_ptr,
    w_ptr,  # [N, Hv, Dk] float32 out
    u_ptr,  # [N, Hv, Dv] float32 out
    aqk_ptr,  # [N, Hv, BT] float32 out
    gc_ptr,  # [N, Hv] float32 out
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    v_token_stride,
    v_head_stride,
    g_token_stride,
    beta_token_stride,
    scale,
    eps,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    KEY_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    VALUE_TILE: tl.constexpr,
    BT: tl.constexpr,
    SUB: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(2)
    key_head = head // GROUP
    first = tl.load(starts_ptr)  # the step's first prefill token
    end = tl.load(starts_ptr + seq + 1) - first
    chunk_start = tl.load(starts_ptr + seq) - first + tl.program_id(1) * BT
    if chunk_start < end:  # else a spare program of a shorter sequence
        i = tl.arange(0, BT)
        rows = chunk_start + i
        row_mask = rows < end
        dk = tl.arange(0, BLOCK_K)
        key_mask = row_mask[:, None] & (dk < KEY_DIM)[None, :]
        k = _l2_normalised_rows(
            k_ptr + rows[:, None] * k_token_stride + key_head * k_head_stride + dk[None, :],
            key_mask,
            eps,
        )
        q = _l2_normalised_rows(
            q_ptr + rows[:, None] * q_token_stride + key_head * q_head_stride + dk[None, :],
            key_mask,
            eps,
        )
        q = q * scale
        g = tl.load(g_ptr + rows * g_token_stride + head, mask=row_mask, other=0.0)
        beta = tl.load(beta_ptr + rows * beta_token_stride + head, mask=row_mask, other=0.0)
        beta = beta.to(tl.float32)
        gc = tl.cumsum(g.to(tl.float32), axis=0)  # log decay from the chunk's start
        tl.store(gc_ptr + rows * NUM_HEADS + head, gc, mask=row_mask)

        causal = i[:, None] >= i[None, :]
        decay = tl.where(causal, tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0)), 0.0)
        kk = tl.dot(k, tl.trans(k), input_precision="ieee")
        a = tl.where(i[:, None] > i[None, :], beta[:, None] * kk * decay, 0.0)
        # (I + A)^-1 in blocks of 16 tokens: first the diagonal blocks' inverses D by forward
        # substitution, row r of every block at once. Row r of D - I is -A_r - sum_{j<r}
        # A_rj (row j of D - I), the rows above r already final and row r's own entries still
        # -A_r: one product of the tile's rows r with the tile adds the sum.
        same_block = (i[:, None] // SUB) == (i[None, :] // SUB)
        inv = tl.where(same_block, -a, 0.0)
        for r in range(1, SUB):
            rows_r = tl.where((i % SUB == r)[:, None], inv, 0.0)
            inv += tl.dot(rows_r, inv, input_precision="ieee")
        inv = tl.where(i[:, None] == i[None, :], 1.0, inv)
        # Then I + A = D^-1 (I + N), N = D A_off (A below the diagonal blocks): N is strictly
        # lower by blocks, N^4 = 0 for BT <= 4 * SUB, so (I + N)^-1 = (I - N)(I + N^2).
        if BT > SUB:
            n = tl.dot(inv, tl.where(same_block, 0.0, a), input_precision="ieee")
            eye = tl.where(i[:, None] == i[None, :], 1.0, 0.0)
            n2 = tl.dot(n, n, input_precision="ieee")
            inv = tl.dot(
                tl.dot(eye - n, eye + n2, input_precision="ieee"), inv, input_precision="ieee"
            )

        aqk = tl.dot(q, tl.trans(k), input_precision="ieee") * decay
        tl.store(
            aqk_ptr + (rows[:, None] * NUM_HEADS + head) * BT + i[None, :],
            aqk,
            mask=row_mask[:, None],
        )
        k_beta = k * (beta * tl.exp(gc))[:, None]
        w = tl.dot(inv, k_beta, input_precision="ieee")
        tl.store(
            w_ptr + (rows[:, None] * NUM_HEADS + head) * KEY_DIM + dk[None, :], w, mask=key_mask
        )
        for v0 in range(0, VALUE_DIM, VALUE_TILE):
            dv = v0 + tl.arange(0, VALUE_TILE)
            value_mask = row_mask[:, None] & (dv < VALUE_DIM)[None, :]
            v = tl.load(
                v_ptr + rows[:, None] * v_token_stride + head * v_head_stride + dv[None, :],
                mask=value_mask,
                other=0.0,
            )
            u = tl.dot(inv, v.to(tl.float32) * beta[:, None], input_precision="ieee")
            tl.store(
                u_ptr + (rows[:, None] * NUM_HEADS + head) * VALUE_DIM + dv[None, :],
                u,
                mask=value_mask,
            )


@triton.jit
def _walk_chunks(
    q_ptr,
    k_ptr,
    w_ptr,
    u_ptr,
    aqk_ptr,
    gc_ptr,
    states_ptr,
    out_ptr,
    starts_ptr,
    slots_ptr,
    has_initial_ptr,
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    out_token_stride,
    out_head_stride,
    state_slot_stride,
    state_head_stride,
    state_key_stride,
    scale,
    eps,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    KEY_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    VALUE_TILE: tl.constexpr,
    BT: tl.constexpr,
    HAS_FRESH: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    key_head = head // GROUP
    dk = tl.arange(0, BLOCK_K)
    dk_mask = dk < KEY_DIM
    dv = tl.program_id(2) * VALUE_TILE + tl.arange(0, VALUE_TILE)
    dv_mask = dv < VALUE_DIM
    first = tl.load(starts_ptr)  # the step's first prefill token
    start = tl.load(starts_ptr + seq) - first
    end = tl.load(starts_ptr + seq + 1) - first

    tile_mask = dk_mask[:, None] & dv_mask[None, :]
    if HAS_FRESH:
        # A where, not an &: Triton 3.9's interpreter cannot & a loaded bool into a block.
        tile_mask = tl.where(tl.load(has_initial_ptr + seq), tile_mask, False)
    slot = tl.load(slots_ptr + seq)
    state_ptrs = (
        states_ptr
        + slot * state_slot_stride
        + head * state_head_stride
        + dk[:, None] * state_key_stride
        + dv[None, :]
    )
    state = tl.load(state_ptrs, mask=tile_mask, other=0.0).to(tl.float32)
    i = tl.arange(0, BT)
    for chunk_start in range(start, end, BT):
        rows = chunk_start + i
        row_mask = rows < end
        key_mask = row_mask[:, None] & dk_mask[None, :]
        value_mask = row_mask[:, None] & dv_mask[None, :]
        q = _l2_normalised_rows(
            q_ptr + rows[:, None] * q_token_stride + key_head * q_head_stride + dk[None, :],
            key_mask,
            eps,
        )
        k = _l2_normalised_rows(
            k_ptr + rows[:, None] * k_token_stride + key_head * k_head_stride + dk[None, :],
            key_mask,
            eps,
        )
        gc = tl.load(gc_ptr + rows * NUM_HEADS + head, mask=row_mask, other=0.0)
        last = tl.minimum(chunk_start + BT, end) - 1
        gc_last = tl.load(gc_ptr + last * NUM_HEADS + head)
        head_rows = rows[:, None] * NUM_HEADS + head
        w = tl.load(w_ptr + head_rows * KEY_DIM + dk[None, :], mask=key_mask, other=0.0)
        u = tl.load(u_ptr + head_rows * VALUE_DIM + dv[None, :], mask=value_mask, other=0.0)
        aqk = tl.load(aqk_ptr + head_rows * BT + i[None, :], mask=row_mask[:, None], other=0.0)

        corrected = u - tl.dot(w, state, input_precision="ieee")  # [BT, VALUE_TILE]
        q_read = q * (scale * tl.exp(gc))[:, None]
        out = tl.dot(q_read, state, input_precision="ieee")
        out += tl.dot(aqk, corrected, input_precision="ieee")
        tl.store(
            out_ptr + rows[:, None] * out_token_stride + head * out_head_stride + dv[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=value_mask,
        )
        # Missing rows have k = 0; keep their factor finite so 0 * it stays 0.
        k_write = k * tl.exp(tl.where(row_mask, gc_last - gc, 0.0))[:, None]
        state = state * tl.exp(gc_last)
        state += tl.dot(tl.trans(k_write), corrected, input_precision="ieee")
    tl.store(
        state_ptrs,
        state.to(states_ptr.dtype.element_ty),
        mask=dk_mask[:, None] & dv_mask[None, :],
    )


def _contiguous_rows(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(x if x.stride(-1) == 1 else x.contiguous() for x in xs)


def _check_pool(states: torch.Tensor) -> None:
    if states.stride(3) != 1:
        raise ValueError("the recurrent-state pool must have unit stride along Dv")


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    meta: LinearAttentionMetadata,
) -> torch.Tensor:
    """As ``reference.gated_delta_rule.recurrent_gated_delta_rule``: one token per decode
    sequence, [B, Hv, Dv] out."""
    q, k, v, g, beta = _contiguous_rows(q, k, v, g, beta)
    _check_pool(states)
    slots, has_initial = meta.decode_slots, meta.decode_has_initial_state
    num_seqs, num_heads, value_dim = v.shape
    key_dim = q.shape[2]
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if num_seqs == 0:
        return out
    tile = min(VALUE_TILE, triton.next_power_of_2(value_dim))
    grid = (num_seqs, num_heads, triton.cdiv(value_dim, tile))
    _delta_rule_step[grid](
        q,
        k,
        v,
        g,
        beta,
        states,
        out,
        slots,
        has_initial,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        beta.stride(0),
        out.stride(0),
        out.stride(1),
        states.stride(0),
        states.stride(1),
        states.stride(2),
        key_dim**-0.5,
        EPS,
        GROUP=num_heads // q.shape[1],
        KEY_DIM=key_dim,
        VALUE_DIM=value_dim,
        BLOCK_K=triton.next_power_of_2(key_dim),
        VALUE_TILE=tile,
        HAS_FRESH=not meta.decodes_have_initial_state,
    )
    return out


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    meta: LinearAttentionMetadata,
) -> torch.Tensor:
    """As ``reference.gated_delta_rule.chunk_gated_delta_rule``: the varlen prefill tokens,
    [N, Hv, Dv] out."""
    p = meta.prefill
    assert p is not None
    q, k, v, g, beta = _contiguous_rows(q, k, v, g, beta)
    _check_pool(states)
    starts = meta.prefill_query_start_loc
    num_tokens, num_heads, value_dim = v.shape
    key_dim = q.shape[2]
    num_seqs = p.state_slots.shape[0]
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if num_seqs == 0 or num_tokens == 0:
        return out
    # The metadata's chunk is min(its maximum, the longest prompt rounded up to a power of
    # two): every prompt fits in chunk_table.shape[1] of them, so in that many tokens.
    size = max(MIN_DOT, min(CHUNK_SIZE, p.chunk_size))
    assert size <= 4 * SUB_CHUNK, "the inverse merges at most four diagonal blocks"
    max_chunks = triton.cdiv(p.chunk_table.shape[1] * p.chunk_size, size)
    block_k = max(MIN_DOT, triton.next_power_of_2(key_dim))
    tile = max(MIN_DOT, min(VALUE_TILE, triton.next_power_of_2(value_dim)))
    walk_tile = max(MIN_DOT, min(WALK_VALUE_TILE, triton.next_power_of_2(value_dim)))

    def f32(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32, device=v.device)

    w = f32(num_tokens, num_heads, key_dim)
    u = f32(num_tokens, num_heads, value_dim)
    aqk = f32(num_tokens, num_heads, size)
    gc = f32(num_tokens, num_heads)
    shapes = dict(
        NUM_HEADS=num_heads,
        GROUP=num_heads // q.shape[1],
        KEY_DIM=key_dim,
        VALUE_DIM=value_dim,
        BLOCK_K=block_k,
        VALUE_TILE=tile,
        BT=size,
    )
    scale = key_dim**-0.5
    _prepare_chunks[(num_seqs, max_chunks, num_heads)](
        q,
        k,
        v,
        g,
        beta,
        starts,
        w,
        u,
        aqk,
        gc,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        beta.stride(0),
        scale,
        EPS,
        SUB=min(SUB_CHUNK, size),
        num_warps=PREFILL_WARPS,
        **shapes,
    )
    _walk_chunks[(num_seqs, num_heads, triton.cdiv(value_dim, walk_tile))](
        q,
        k,
        w,
        u,
        aqk,
        gc,
        states,
        out,
        starts,
        p.state_slots,
        p.has_initial_state,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        out.stride(0),
        out.stride(1),
        states.stride(0),
        states.stride(1),
        states.stride(2),
        scale,
        EPS,
        HAS_FRESH=not p.all_have_initial_state,
        num_warps=PREFILL_WARPS,
        **{**shapes, "VALUE_TILE": walk_tile},
    )
    return out
