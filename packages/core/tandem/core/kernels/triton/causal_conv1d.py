"""The Gated DeltaNet's depthwise causal conv1d (then SiLU) in Triton, over a varlen prefill
chunk and over one decode token per sequence, each sequence continuing the conv state in its
slot (``reference/causal_conv1d.py`` states the layout: ``[num_slots + 1, C, K - 1]``, oldest
input first).

Prefill reads what the reference reads: the rows of [new tokens | each sequence's old state as
K - 1 rows] named by the metadata's gather indices (``conv_window_index``: tap j of token t;
``conv_state_index``: the rows that become each sequence's next state). So every output is
independent of the others: a program per (tile of tokens, tile of channels) gathers its K
taps, with no walk along a sequence and no knowledge of where sequences start; a second small
launch writes the new states, a program per (tile of the B (K - 1) state rows, tile of
channels). A sequence without a state reads zeros for its old rows, whatever its slot holds.

Decode: a program per (sequence, tile of channels) reads the K - 1 state inputs and the new
token, and writes the state shifted by one.

Both read the old states from a copy gathered before the launch (``index_select``, as the
reference does), never from the pool they write: each element of a state moves, so it is read
by one thread (or program) and overwritten by another, and only the copy orders the two
without a barrier. The copy is ``B C (K - 1)`` elements, small beside the prefill's ``N C``
inputs and beside the recurrent state a decode step moves.

Rounding as the reference: old state values are converted to the input dtype first, every
product and sum is float32 (the taps summed in tap order, as the reference's ``addcmul_``
chain), the convolution is rounded once to the input dtype, and SiLU is taken of that rounded
value in float32 and rounded again (torch's half-precision SiLU computes in float32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.core.kernels.linear_attention_metadata import LinearAttentionMetadata
from tandem.core.kernels.reference.causal_conv1d import check_activation

ROWS = 16  # tokens (or state rows) per program
CHANNELS = 64  # channels per program


@triton.jit
def _source_rows(
    x_ptr,
    old_ptr,
    has_initial_ptr,
    rows,
    mask,
    c,
    c_mask,
    x_stride,
    num_tokens,
    num_channels,
    HISTORY: tl.constexpr,
    HAS_FRESH: tl.constexpr,
):
    """Rows ``rows`` of the reference's source [new tokens | old states, K - 1 rows per
    sequence] for the channels ``c``, widened to float32 (old ones through the input dtype,
    as the reference converts them; zeros for a sequence without a state)."""
    new = rows < num_tokens
    inputs = tl.load(
        x_ptr + rows[:, None] * x_stride + c[None, :],
        mask=(mask & new)[:, None] & c_mask[None, :],
        other=0.0,
    )
    old_row = rows - num_tokens
    seq = old_row // HISTORY
    old_mask = mask & (old_row >= 0)
    if HAS_FRESH:
        old_mask = old_mask & (tl.load(has_initial_ptr + seq, mask=old_mask, other=0) != 0)
    # The old states' copy is [B, C, K - 1], contiguous.
    offsets = (seq * num_channels)[:, None] * HISTORY + c[None, :] * HISTORY
    old = tl.load(
        old_ptr + offsets + (old_row % HISTORY)[:, None],
        mask=old_mask[:, None] & c_mask[None, :],
        other=0.0,
    )
    old = old.to(x_ptr.dtype.element_ty).to(tl.float32)
    return tl.where(new[:, None], inputs.to(tl.float32), old)


@triton.jit
def _conv_prefill(
    x_ptr,
    weight_ptr,
    old_ptr,
    out_ptr,
    window_ptr,
    has_initial_ptr,
    x_stride,
    out_stride,
    weight_stride,
    window_stride,
    num_tokens,
    num_channels,
    KERNEL: tl.constexpr,
    HAS_FRESH: tl.constexpr,
    ROWS: tl.constexpr,
    CHANNELS: tl.constexpr,
):
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    t_mask = t < num_tokens
    c = tl.program_id(1) * CHANNELS + tl.arange(0, CHANNELS)
    c_mask = c < num_channels
    acc = tl.zeros([ROWS, CHANNELS], dtype=tl.float32)
    for tap in tl.static_range(KERNEL):
        rows = tl.load(window_ptr + tap * window_stride + t, mask=t_mask, other=0)
        inputs = _source_rows(
            x_ptr,
            old_ptr,
            has_initial_ptr,
            rows,
            t_mask,
            c,
            c_mask,
            x_stride,
            num_tokens,
            num_channels,
            KERNEL - 1,
            HAS_FRESH,
        )
        w = tl.load(weight_ptr + c * weight_stride + tap, mask=c_mask, other=0.0)
        acc += inputs * w.to(tl.float32)[None, :]
    y = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    y = y / (1.0 + tl.exp(-y))
    tl.store(
        out_ptr + t[:, None] * out_stride + c[None, :],
        y.to(out_ptr.dtype.element_ty),
        mask=t_mask[:, None] & c_mask[None, :],
    )


@triton.jit
def _conv_prefill_states(
    x_ptr,
    old_ptr,
    states_ptr,
    state_index_ptr,
    slots_ptr,
    has_initial_ptr,
    x_stride,
    state_slot_stride,
    state_channel_stride,
    state_input_stride,
    num_seqs,
    num_tokens,
    num_channels,
    HISTORY: tl.constexpr,
    HAS_FRESH: tl.constexpr,
    ROWS: tl.constexpr,
    CHANNELS: tl.constexpr,
):
    # Entry e of the [K - 1, B] state index: input i = e // B of sequence b = e % B.
    e = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    e_mask = e < HISTORY * num_seqs
    c = tl.program_id(1) * CHANNELS + tl.arange(0, CHANNELS)
    c_mask = c < num_channels
    rows = tl.load(state_index_ptr + e, mask=e_mask, other=0)
    inputs = _source_rows(
        x_ptr,
        old_ptr,
        has_initial_ptr,
        rows,
        e_mask,
        c,
        c_mask,
        x_stride,
        num_tokens,
        num_channels,
        HISTORY,
        HAS_FRESH,
    )
    slot = tl.load(slots_ptr + e % num_seqs, mask=e_mask, other=0)
    offsets = slot * state_slot_stride + (e // num_seqs) * state_input_stride
    tl.store(
        states_ptr + offsets[:, None] + c[None, :] * state_channel_stride,
        inputs.to(x_ptr.dtype.element_ty).to(states_ptr.dtype.element_ty),
        mask=e_mask[:, None] & c_mask[None, :],
    )


@triton.jit
def _conv_update(
    x_ptr,
    weight_ptr,
    old_ptr,
    states_ptr,
    out_ptr,
    slots_ptr,
    has_initial_ptr,
    x_stride,
    out_stride,
    weight_stride,
    state_slot_stride,
    state_channel_stride,
    state_input_stride,
    num_channels,
    KERNEL: tl.constexpr,
    HAS_FRESH: tl.constexpr,
    CHANNELS: tl.constexpr,
):
    seq = tl.program_id(0)
    c = tl.program_id(1) * CHANNELS + tl.arange(0, CHANNELS)
    c_mask = c < num_channels
    old_mask = c_mask
    if HAS_FRESH:
        # A where, not an &: Triton 3.9's interpreter cannot & a loaded bool into a block.
        old_mask = tl.where(tl.load(has_initial_ptr + seq), old_mask, False)
    state = states_ptr + tl.load(slots_ptr + seq) * state_slot_stride + c * state_channel_stride
    acc = tl.zeros([CHANNELS], dtype=tl.float32)
    for tap in tl.static_range(KERNEL - 1):
        old = tl.load(old_ptr + (seq * num_channels + c) * (KERNEL - 1) + tap, mask=old_mask)
        old = old.to(x_ptr.dtype.element_ty)
        w = tl.load(weight_ptr + c * weight_stride + tap, mask=c_mask, other=0.0)
        acc += old.to(tl.float32) * w.to(tl.float32)
        if tap > 0:  # input tap becomes input tap - 1 of the next state
            new = old.to(states_ptr.dtype.element_ty)
            tl.store(state + (tap - 1) * state_input_stride, new, mask=c_mask)
    x = tl.load(x_ptr + seq * x_stride + c, mask=c_mask, other=0.0)
    w = tl.load(weight_ptr + c * weight_stride + KERNEL - 1, mask=c_mask, other=0.0)
    acc += x.to(tl.float32) * w.to(tl.float32)
    new = x.to(states_ptr.dtype.element_ty)
    tl.store(state + (KERNEL - 2) * state_input_stride, new, mask=c_mask)
    y = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    y = y / (1.0 + tl.exp(-y))
    tl.store(out_ptr + seq * out_stride + c, y.to(out_ptr.dtype.element_ty), mask=c_mask)


def _unit_columns(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _prepared(
    x: torch.Tensor, weight: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` and the taps with unit column stride, and the output to fill."""
    check_activation(activation)
    x = _unit_columns(x)
    return x, _unit_columns(weight), torch.empty(x.shape, dtype=x.dtype, device=x.device)


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    meta: LinearAttentionMetadata,
    activation: str,
) -> torch.Tensor:
    """As ``reference.causal_conv1d.causal_conv1d_prefill``: ``x`` [N, C] -> [N, C]."""
    p = meta.prefill
    assert p is not None
    x, weight, out = _prepared(x, weight, activation)
    num_tokens, channels = x.shape
    kernel = weight.shape[1]
    num_seqs = p.state_slots.shape[0]
    old = conv_states.index_select(0, p.state_slots)  # [B, C, K - 1], contiguous
    window = _unit_columns(p.conv_window_index)
    state_index = p.conv_state_index.contiguous()
    fresh = not p.all_have_initial_state
    channel_tiles = triton.cdiv(channels, CHANNELS)
    _conv_prefill[(triton.cdiv(num_tokens, ROWS), channel_tiles)](
        x,
        weight,
        old,
        out,
        window,
        p.has_initial_state,
        x.stride(0),
        out.stride(0),
        weight.stride(0),
        window.stride(0),
        num_tokens,
        channels,
        KERNEL=kernel,
        HAS_FRESH=fresh,
        ROWS=ROWS,
        CHANNELS=CHANNELS,
    )
    _conv_prefill_states[(triton.cdiv((kernel - 1) * num_seqs, ROWS), channel_tiles)](
        x,
        old,
        conv_states,
        state_index,
        p.state_slots,
        p.has_initial_state,
        x.stride(0),
        conv_states.stride(0),
        conv_states.stride(1),
        conv_states.stride(2),
        num_seqs,
        num_tokens,
        channels,
        HISTORY=kernel - 1,
        HAS_FRESH=fresh,
        ROWS=ROWS,
        CHANNELS=CHANNELS,
    )
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    meta: LinearAttentionMetadata,
    activation: str,
) -> torch.Tensor:
    """As ``reference.causal_conv1d.causal_conv1d_update``: ``x`` [B, C] -> [B, C]."""
    x, weight, out = _prepared(x, weight, activation)
    num_seqs, channels = x.shape
    slots = meta.decode_slots
    if num_seqs == 0:
        return out
    old = conv_states.index_select(0, slots)  # [B, C, K - 1], contiguous
    _conv_update[(num_seqs, triton.cdiv(channels, CHANNELS))](
        x,
        weight,
        old,
        conv_states,
        out,
        slots,
        meta.decode_has_initial_state,
        x.stride(0),
        out.stride(0),
        weight.stride(0),
        conv_states.stride(0),
        conv_states.stride(1),
        conv_states.stride(2),
        channels,
        KERNEL=weight.shape[1],
        HAS_FRESH=not meta.decodes_have_initial_state,
        CHANNELS=CHANNELS,
    )
    return out
