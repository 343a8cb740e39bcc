"""Turn a step's block tables and lengths into the gather indices and masks attention uses.

All of it is tensor arithmetic over the whole batch, done once per step and shared by every
layer; no per-token Python. Hybrid models' linear-attention layers get theirs (state slots,
conv windows, chunk layout) in the same pass.

Built in two halves so that an accelerator's step reads nothing back: ``plan_attention_metadata``
does every data-dependent part on the host, from the step's host tensors (the longest
context, the padded query count, which rows are real), and lists the small index tensors
the device needs; whoever moves the step copies them together with its own inputs in one
transfer (``to_device_once``, or a lane's stager); ``AttentionPlan.finish`` then builds the
masks on the device from them, with sizes the host already knows.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from tandem.core.kernels.attention_metadata import (
    AttentionGroup,
    AttentionMetadata,
    AttentionPlan,
    FinishGroup,
)
from tandem.core.kernels.device_copy import to_device_once
from tandem.core.kernels.linear_attention_metadata import plan_linear_attention_metadata
from tandem.core.llm.forward_input import ForwardInput


def _gather_blocks(
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int
) -> torch.Tensor:
    """[B, N] blocks to read: enough for the longest context. Whole blocks are copied (16 KiB
    rows instead of one row per token); masks hide what lies past each sequence's end."""
    num_blocks = -(-int(context_lens.max()) // block_size)
    return block_tables[:, :num_blocks]


def _plan_decode(fi: ForwardInput, tensors: list[torch.Tensor]) -> FinishGroup:
    n = fi.num_decodes
    return _plan_decode_group(fi.block_tables[:n], fi.context_lens[:n], fi.block_size, tensors)


def _plan_decode_group(
    tables: torch.Tensor, ctx: torch.Tensor, block_size: int, tensors: list[torch.Tensor]
) -> FinishGroup:
    n = ctx.shape[0]
    blocks = _gather_blocks(tables, ctx, block_size)
    length = blocks.shape[1] * block_size
    masked = int(ctx.min()) != length
    host_kv_lens = ctx.to(torch.int32)
    tensors += [blocks, ctx, torch.arange(n)]

    def finish(parts: Iterator[torch.Tensor], device: torch.device) -> AttentionGroup:
        blocks, ctx, table_row = next(parts), next(parts), next(parts)
        mask = None
        if masked:
            pos = torch.arange(length, device=device)
            mask = (pos.unsqueeze(0) < ctx.unsqueeze(1)).view(n, 1, 1, -1)
        return AttentionGroup(
            gather_blocks=blocks,
            mask=mask,
            query_index=None,
            valid_queries=None,
            num_tokens=n,
            kv_lens=ctx,
            table_row=table_row,
            host_kv_lens=host_kv_lens,
        )

    return finish


def _plan_prefill(fi: ForwardInput, tensors: list[torch.Tensor]) -> FinishGroup:
    n = fi.num_decodes
    qlens = fi.query_lens[n:]
    ctx = fi.context_lens[n:]
    blocks = _gather_blocks(fi.block_tables[n:], ctx, fi.block_size)
    max_q = int(qlens.max())
    num_tokens = int(qlens.sum())
    length = blocks.shape[1] * fi.block_size
    starts = torch.cumsum(qlens, 0) - qlens  # first token of each sequence within the group
    j = torch.arange(max_q).unsqueeze(0)  # [1, Q]
    # Padded query rows repeat the sequence's last real query: never an all-masked row.
    j_real = torch.minimum(j, (qlens - 1).unsqueeze(1))
    query_index = starts.unsqueeze(1) + j_real
    q_pos = (ctx - qlens).unsqueeze(1) + j_real  # [B, Q] absolute position of each query
    valid = (j < qlens.unsqueeze(1)).reshape(-1).nonzero().squeeze(1)
    host_kv_lens, host_query_lens = ctx.to(torch.int32), qlens.to(torch.int32)
    tensors += [blocks, query_index, valid, starts, qlens, ctx, q_pos]

    def finish(parts: Iterator[torch.Tensor], device: torch.device) -> AttentionGroup:
        blocks, query_index, valid, starts, qlens, ctx, q_pos = (next(parts) for _ in range(7))
        ctx_pos = torch.arange(length, device=device)
        mask = (ctx_pos.view(1, 1, -1) <= q_pos.unsqueeze(2)).unsqueeze(1)  # [B, 1, Q, L]
        return AttentionGroup(
            gather_blocks=blocks,
            mask=mask,
            query_index=query_index,
            valid_queries=valid,
            num_tokens=num_tokens,
            seq_query_start=starts,
            seq_query_len=qlens,
            seq_kv_len=ctx,
            host_kv_lens=host_kv_lens,
            host_query_lens=host_query_lens,
        )

    return finish


def plan_attention_metadata(fi: ForwardInput, conv_kernel_size: int | None = None) -> AttentionPlan:
    """The host half, from ``fi``'s host tensors. ``conv_kernel_size``: for models with
    linear-attention layers, their conv width; the metadata then also carries the step's
    state slots (``linear``)."""
    num_seqs = fi.query_lens.shape[0]
    tensors: list[torch.Tensor] = [fi.slot_mapping]
    decode = _plan_decode(fi, tensors) if fi.num_decodes else None
    prefill = _plan_prefill(fi, tensors) if num_seqs > fi.num_decodes else None
    linear = None
    if conv_kernel_size is not None:
        linear = plan_linear_attention_metadata(
            fi.query_lens,
            fi.context_lens,
            fi.state_slots,
            num_decodes=fi.num_decodes,
            conv_kernel_size=conv_kernel_size,
            tensors=tensors,
            num_verifies=fi.num_verifies,
            verify_scratch=fi.verify_scratch,
        )
    return AttentionPlan(tensors, fi.num_decodes, decode, prefill, linear)


def plan_decode_metadata(
    positions: torch.Tensor, block_tables: torch.Tensor, block_size: int
) -> AttentionPlan:
    """The host half for one new token per sequence at ``positions`` [B] (host), written to
    and reading the blocks of ``block_tables`` [B, N]: a multi-token-prediction head's later
    drafts, which run on their own after the step's forward."""
    rows = torch.arange(positions.shape[0])
    slot_mapping = block_tables[rows, positions // block_size] * block_size + positions % block_size
    tensors: list[torch.Tensor] = [slot_mapping]
    decode = _plan_decode_group(block_tables, positions + 1, block_size, tensors)
    return AttentionPlan(tensors, positions.shape[0], decode, None, None)


def build_attention_metadata(
    fi: ForwardInput, device: torch.device, conv_kernel_size: int | None = None
) -> AttentionMetadata:
    """Both halves, the metadata's tensors moved in one copy."""
    plan = plan_attention_metadata(fi, conv_kernel_size)
    return plan.finish(to_device_once(plan.tensors, device), device)
