"""Turn a step's block tables and lengths into the gather indices and masks attention uses.

All of it is tensor arithmetic over the whole batch, done once per step and shared by every
layer; no per-token Python. Hybrid models' linear-attention layers get theirs (state slots,
conv windows, chunk layout) in the same pass.
"""

from __future__ import annotations

import torch

from tandem.core.kernels.attention_metadata import AttentionGroup, AttentionMetadata
from tandem.core.kernels.linear_attention_metadata import build_linear_attention_metadata
from tandem.core.llm.forward_input import ForwardInput


def _gather_blocks(
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int
) -> torch.Tensor:
    """[B, N] blocks to read: enough for the longest context. Whole blocks are copied (16 KiB
    rows instead of one row per token); masks hide what lies past each sequence's end."""
    num_blocks = -(-int(context_lens.max()) // block_size)
    return block_tables[:, :num_blocks]


def _decode_group(fi: ForwardInput, device: torch.device) -> AttentionGroup:
    n = fi.num_decodes
    ctx = fi.context_lens[:n].to(device)
    blocks = _gather_blocks(fi.block_tables[:n].to(device), ctx, fi.block_size)
    length = blocks.shape[1] * fi.block_size
    mask = None
    if int(ctx.min()) != length:
        pos = torch.arange(length, device=device)
        mask = (pos.unsqueeze(0) < ctx.unsqueeze(1)).view(n, 1, 1, -1)
    return AttentionGroup(
        gather_blocks=blocks,
        mask=mask,
        query_index=None,
        valid_queries=None,
        num_tokens=n,
        kv_lens=ctx,
        table_row=torch.arange(n, device=device),
    )


def _prefill_group(fi: ForwardInput, device: torch.device) -> AttentionGroup:
    n = fi.num_decodes
    qlens = fi.query_lens[n:].to(device)
    ctx = fi.context_lens[n:].to(device)
    blocks = _gather_blocks(fi.block_tables[n:].to(device), ctx, fi.block_size)
    max_q = int(qlens.max())
    starts = torch.cumsum(qlens, 0) - qlens  # first token of each sequence within the group
    j = torch.arange(max_q, device=device).unsqueeze(0)  # [1, Q]
    # Padded query rows repeat the sequence's last real query: never an all-masked row.
    j_real = torch.minimum(j, (qlens - 1).unsqueeze(1))
    query_index = starts.unsqueeze(1) + j_real
    q_pos = (ctx - qlens).unsqueeze(1) + j_real  # [B, Q] absolute position of each query
    ctx_pos = torch.arange(blocks.shape[1] * fi.block_size, device=device)
    mask = (ctx_pos.view(1, 1, -1) <= q_pos.unsqueeze(2)).unsqueeze(1)  # [B, 1, Q, L]
    valid = (j < qlens.unsqueeze(1)).reshape(-1).nonzero().squeeze(1)
    return AttentionGroup(
        gather_blocks=blocks,
        mask=mask,
        query_index=query_index,
        valid_queries=valid,
        num_tokens=int(qlens.sum()),
        seq_query_start=starts,
        seq_query_len=qlens,
        seq_kv_len=ctx,
    )


def build_attention_metadata(
    fi: ForwardInput, device: torch.device, conv_kernel_size: int | None = None
) -> AttentionMetadata:
    """``conv_kernel_size``: for models with linear-attention layers, their conv width; the
    metadata then also carries the step's state slots (``linear``)."""
    num_seqs = fi.query_lens.shape[0]
    linear = None
    if conv_kernel_size is not None:
        linear = build_linear_attention_metadata(
            fi.query_lens,
            fi.context_lens,
            fi.state_slots,
            num_decodes=fi.num_decodes,
            conv_kernel_size=conv_kernel_size,
            device=device,
        )
    return AttentionMetadata(
        slot_mapping=fi.slot_mapping.to(device),
        num_decode_tokens=fi.num_decodes,
        decode=_decode_group(fi, device) if fi.num_decodes else None,
        prefill=_prefill_group(fi, device) if num_seqs > fi.num_decodes else None,
        linear=linear,
    )
