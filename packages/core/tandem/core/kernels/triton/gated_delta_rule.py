"""The gated delta rule of Gated DeltaNet in Triton (``reference/gated_delta_rule.py`` states
the recurrence and the state pool ``[num_slots + 1, Hv, Dk, Dv]``): the one-token decode step
and the varlen prefill, each continuing every sequence's recurrent state in its slot.

Both are one kernel, the recurrence taken token by token: a program per (sequence, value head,
tile of ``Dv``) holds its ``[Dk, Dv-tile]`` slice of the state in float32 registers from the
first token of its sequence in this call to the last, and writes it back once. Each token
costs the decay, two reductions over ``Dk`` (the state's prediction of ``v``, then the output)
and one rank-one update: elementwise work and reductions on the tile, no ``tl.dot``. The
value-dim tiles of a head are independent (each column of the state evolves on its own given
k, g and beta), so they are separate programs; each recomputes the head's L2 norms of q and
k, which is cheap beside the state. Decode is the same kernel with one token per sequence.
For long prompts the walk is serial in the tokens (latency-bound); the chunked (WY /
UT-transform) form the reference uses trades it for matrix products over chunks of tokens
and is the next step; this walk is the first, plainly correct version.

Sequences without an initial state (a first chunk) start from zeros, whatever their slot
holds: the state is loaded masked, so not even NaN in the slot reaches them. Each program
reads and writes only its own state slice, in the same layout, so the update in place needs
no copy.

Rounding as the reference: q and k are L2-normalised in float32 (``x * rsqrt(sum x^2 +
1e-6)``, q then scaled by ``Dk^-1/2``); v, g and beta are widened to float32; the state, the
recurrence and the output are float32; the output is rounded once to ``v``'s dtype and the
state to the pool's. The two differ from the reference only in the order of float32 sums (and,
for prefill, in taking the recurrence step by step instead of in chunks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.core.kernels.linear_attention_metadata import LinearAttentionMetadata

EPS = 1e-6  # the L2 norm's, as reference.l2norm
VALUE_TILE = 32  # Dv columns of the state per program


@triton.jit
def _l2_normalised(ptr, d, mask, eps):
    """The vector ``ptr[d]`` widened to float32 and L2-normalised."""
    x = tl.load(ptr + d, mask=mask, other=0.0).to(tl.float32)
    return x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) + eps))


@triton.jit
def _delta_rule(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    states_ptr,
    out_ptr,
    starts_ptr,
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
    VARLEN: tl.constexpr,
    HAS_FRESH: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    key_head = head // GROUP
    dk = tl.arange(0, BLOCK_K)
    dk_mask = dk < KEY_DIM
    dv = tl.program_id(2) * VALUE_TILE + tl.arange(0, VALUE_TILE)
    dv_mask = dv < VALUE_DIM
    if VARLEN:
        first = tl.load(starts_ptr)  # the step's first token of this kind
        start = tl.load(starts_ptr + seq) - first
        end = tl.load(starts_ptr + seq + 1) - first
    else:  # one token per sequence
        start = seq
        end = seq + 1

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
    for t in range(start, end):
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


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    has_initial: torch.Tensor,
    all_have_initial: bool,
    starts: torch.Tensor | None,
) -> torch.Tensor:
    """One launch for ``slots`` (and ``starts``, varlen; else one token per sequence)."""
    q, k, v, g, beta = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, g, beta))
    if states.stride(3) != 1:
        raise ValueError("the recurrent-state pool must have unit stride along Dv")
    num_tokens, num_heads, value_dim = v.shape
    key_dim = q.shape[2]
    num_seqs = slots.shape[0]
    out = torch.empty((num_tokens, num_heads, value_dim), dtype=v.dtype, device=v.device)
    if num_seqs == 0:
        return out
    tile = min(VALUE_TILE, triton.next_power_of_2(value_dim))
    grid = (num_seqs, num_heads, triton.cdiv(value_dim, tile))
    _delta_rule[grid](
        q,
        k,
        v,
        g,
        beta,
        states,
        out,
        slots if starts is None else starts,
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
        VARLEN=starts is not None,
        HAS_FRESH=not all_have_initial,
    )
    return out


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
    slots, has_initial = meta.decode_slots, meta.decode_has_initial_state
    every = meta.decodes_have_initial_state
    return _launch(q, k, v, g, beta, states, slots, has_initial, every, None)


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
    starts = meta.query_start_loc[meta.num_decodes :]
    every = p.all_have_initial_state
    return _launch(q, k, v, g, beta, states, p.state_slots, p.has_initial_state, every, starts)
