"""Turn the scheduler's decision into a ForwardInput, with batched tensor arithmetic."""

from __future__ import annotations

import torch

from tandem.core.kv.block_pool import NULL_BLOCK
from tandem.core.llm.forward_input import ForwardInput, SamplingBatch
from tandem.core.llm.scheduler import SchedulerOutput


def build_forward_input(out: SchedulerOutput, block_size: int) -> ForwardInput:
    entries = out.scheduled
    input_ids: list[int] = []
    starts: list[int] = []
    query_lens: list[int] = []
    max_blocks = max(len(e.seq.block_table) for e in entries)
    tables: list[list[int]] = []
    for e in entries:
        seq = e.seq
        start = seq.num_computed_tokens
        input_ids.extend(seq.token_ids[start : start + e.num_new_tokens])
        starts.append(start)
        query_lens.append(e.num_new_tokens)
        tables.append(seq.block_table + [NULL_BLOCK] * (max_blocks - len(seq.block_table)))

    qlens = torch.tensor(query_lens, dtype=torch.int64)
    start_t = torch.tensor(starts, dtype=torch.int64)
    block_tables = torch.tensor(tables, dtype=torch.int64)
    num_tokens = len(input_ids)
    seq_of_token = torch.repeat_interleave(torch.arange(len(entries)), qlens)
    first_token = torch.cumsum(qlens, 0) - qlens
    positions = start_t[seq_of_token] + torch.arange(num_tokens) - first_token[seq_of_token]
    slot_mapping = (
        block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    )
    num_decodes = sum(1 for q in query_lens if q == 1)

    sample_rows = [i for i, e in enumerate(entries) if e.samples]
    sample_indices = (torch.cumsum(qlens, 0) - 1)[sample_rows]
    return ForwardInput(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=positions,
        slot_mapping=slot_mapping,
        query_lens=qlens,
        context_lens=start_t + qlens,
        block_tables=block_tables,
        num_decodes=num_decodes,
        sample_indices=sample_indices,
        sampling=_sampling_batch(out, sample_rows),
        block_size=block_size,
    )


def _sampling_batch(out: SchedulerOutput, rows: list[int]) -> SamplingBatch:
    params = [out.scheduled[i].seq.params for i in rows]
    steps = tuple(out.scheduled[i].seq.num_output_tokens for i in rows)
    asked = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingBatch(
        temperatures=torch.tensor([p.temperature for p in params], dtype=torch.float32),
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
        top_k=torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.int64),
        seeds=tuple(p.seed for p in params),
        steps=steps,
        all_greedy=all(p.is_greedy for p in params),
        needs_top_k_top_p=any(not p.is_greedy and (p.top_k > 0 or p.top_p < 1.0) for p in params),
        max_logprobs=max(asked) if asked else None,
    )
