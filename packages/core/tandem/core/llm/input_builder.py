"""Turn the scheduler's decision into a ForwardInput, with batched tensor arithmetic."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from tandem.core.kv.block_pool import NULL_BLOCK
from tandem.core.llm.forward_input import (
    AheadInputs,
    DraftRows,
    ForwardInput,
    GrammarMasks,
    PromptLogprobsRequest,
    SamplingBatch,
    StateCopies,
)
from tandem.core.llm.sampling_rows import SamplingRows
from tandem.core.llm.scheduler import ScheduledSequence, SchedulerOutput
from tandem.core.llm.sequence import TokenSequence


def build_forward_input(
    out: SchedulerOutput,
    block_size: int,
    rows: SamplingRows | None = None,
    alone: bool = True,
    ahead: bool = False,
) -> ForwardInput:
    """The step's tensors, built with numpy on the host: a handful of small array ops that
    never release the GIL (each torch op would, and under a busy event loop every release
    can cost a wait for the GIL back), then handed to torch without a copy. ``rows``: the
    engine's logits-processor slots, assigned last (only a step that is built takes them);
    ``alone``: no other step is in flight (``SamplingRows.assign``); ``ahead``: a
    multi-token-prediction head drafts (``AheadInputs``)."""
    entries = out.scheduled
    num_seqs = len(entries)
    query_lens: list[int] = []
    starts: list[int] = []
    input_ids: list[int] = []
    sample_rows: list[int] = []
    max_blocks = 0
    for row, e in enumerate(entries):
        seq = e.seq
        start = seq.num_computed_tokens
        drafts = e.draft_token_ids
        input_ids += seq.token_ids[start : start + e.num_new_tokens - len(drafts)]
        input_ids += drafts
        starts.append(start)
        query_lens.append(e.num_new_tokens)
        max_blocks = max(max_blocks, len(seq.block_table))
        if e.samples:
            sample_rows.append(row)
    tables = np.full((num_seqs, max_blocks), NULL_BLOCK, dtype=np.int64)
    for row, e in enumerate(entries):
        table = e.seq.block_table
        tables[row, : len(table)] = table
    qlens = np.array(query_lens, dtype=np.int64)
    start_arr = np.array(starts, dtype=np.int64)
    ends = np.cumsum(qlens)
    first_token = ends - qlens
    seq_of_token = np.repeat(np.arange(num_seqs), qlens)
    positions = np.arange(len(input_ids), dtype=np.int64) + (start_arr - first_token)[seq_of_token]
    slot_mapping = (
        tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    )
    num_decodes = sum(1 for q in query_lens if q == 1)
    verifying = [e for e in entries[num_decodes:] if e.scratch_rows]
    verify_scratch = None
    if verifying:
        verify_scratch = torch.tensor([r for e in verifying for r in e.scratch_rows])
    sample_seqs = [entries[i].seq for i in sample_rows]
    num_drafts = [len(entries[i].draft_token_ids) for i in sample_rows]
    sample_indices = ends[sample_rows] - 1
    if any(num_drafts):
        runs = [entries[i].draft_token_ids for i in sample_rows]
        sample_indices, sampling = _verify_rows(sample_seqs, runs, sample_indices)
    else:
        sampling = _sampling_batch(sample_seqs, [s.num_output_tokens for s in sample_seqs])
    prompt_logprobs = _prompt_logprobs(out, starts, first_token.tolist())
    if rows is not None:
        slots, update = rows.assign(sample_seqs, alone)
        if slots is not None and sampling.drafts is not None:
            # One slot per sampled position: a verify row's positions use no processor.
            slots = torch.repeat_interleave(slots, torch.tensor(num_drafts) + 1)
        sampling = replace(sampling, slots=slots, update=update)
    return ForwardInput(
        input_ids=torch.from_numpy(np.array(input_ids, dtype=np.int64)),
        positions=torch.from_numpy(positions),
        slot_mapping=torch.from_numpy(slot_mapping),
        query_lens=torch.from_numpy(qlens),
        context_lens=torch.from_numpy(start_arr + qlens),
        block_tables=torch.from_numpy(tables),
        state_slots=torch.from_numpy(np.array([e.seq.state_slot for e in entries], np.int64)),
        num_decodes=num_decodes,
        sample_indices=torch.from_numpy(sample_indices),
        sampling=sampling,
        block_size=block_size,
        prompt_logprobs=prompt_logprobs,
        state_copies=_state_copies(entries, out.rollbacks),
        num_verifies=len(verifying),
        verify_scratch=verify_scratch,
        ahead=_ahead_inputs(entries, starts, ends, sample_rows, num_drafts) if ahead else None,
    )


def _ahead_inputs(
    entries: list[ScheduledSequence],
    starts: list[int],
    ends: np.ndarray,
    sample_rows: list[int],
    num_drafts: list[int],
) -> AheadInputs:
    """Where each sequence's tokens end, the prompt token after a chunk that does not reach
    the prompt's end (-1 for sequences that sample: their next token is this step's), and
    each sampling sequence's last known token (its index in the step, and on the host its
    position and row)."""
    next_ids = [
        -1 if e.samples else e.seq.token_ids[start + e.num_new_tokens - len(e.draft_token_ids)]
        for e, start in zip(entries, starts, strict=True)
    ]
    drafted = np.array(num_drafts, dtype=np.int64)
    after = ends[sample_rows] - 1 - drafted
    rows = np.array(sample_rows, dtype=np.int64)
    last_known = (
        np.array([starts[i] + entries[i].num_new_tokens - 1 for i in sample_rows], dtype=np.int64)
        - drafted
    )
    return AheadInputs(
        last_index=torch.from_numpy(ends - 1),
        next_ids=torch.tensor(next_ids, dtype=torch.int64),
        sampled_after=torch.from_numpy(after.astype(np.int64)),
        sampled_positions=torch.from_numpy(last_known),
        sampled_rows=torch.from_numpy(rows),
    )


def _state_copies(
    entries: list[ScheduledSequence], rollbacks: list[tuple[int, int]]
) -> StateCopies | None:
    """The state copies the scheduler asked of this step (hybrid models: rollbacks of
    rejected drafts, prefix caching's snapshots)."""
    blocks = tuple(e.copy_block for e in entries if e.copy_block is not None)
    restores = tuple(
        (e.restore_row, e.seq.state_slot) for e in entries if e.restore_row is not None
    )
    snapshots = tuple(
        (e.seq.state_slot, e.snapshot_row) for e in entries if e.snapshot_row is not None
    )
    if not (blocks or restores or snapshots or rollbacks):
        return None
    return StateCopies(
        blocks=blocks, restores=restores, snapshots=snapshots, rollbacks=tuple(rollbacks)
    )


def _verify_rows(
    seqs: list[TokenSequence], drafts: list[tuple[int, ...]], last_indices: np.ndarray
) -> tuple[np.ndarray, SamplingBatch]:
    """A step with drafts samples each sequence at its last known token and at each of its
    drafts: the token indices of those 1 + k positions per sequence (``last_indices``: each
    sequence's last token), and a sampling row for each, counting the outputs before it."""
    counts = np.array([len(d) for d in drafts], dtype=np.int64) + 1
    row_of = np.repeat(np.arange(len(seqs)), counts)
    # Each position's place in its sequence's run: 0 (last known token), 1 .. k (drafts).
    offset = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    indices = last_indices[row_of] - (counts[row_of] - 1) + offset
    steps = np.array([s.num_output_tokens for s in seqs], dtype=np.int64)[row_of] + offset
    sampling = _sampling_batch([seqs[r] for r in row_of.tolist()], steps.tolist())
    rows = DraftRows(
        num_drafts=tuple(len(d) for d in drafts), token_ids=tuple(t for d in drafts for t in d)
    )
    return indices, replace(sampling, drafts=rows)


def _sampling_batch(seqs: list[TokenSequence], steps: list[int]) -> SamplingBatch:
    """One row per sampled position: ``seqs`` and the count of output tokens before each."""
    params = [seq.params for seq in seqs]
    asked = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingBatch(
        # Rows below the greedy threshold sample greedily: the sampler knows them by 0.
        temperatures=torch.tensor(
            [0.0 if p.is_greedy else p.temperature for p in params], dtype=torch.float32
        ),
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
        top_k=torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.int64),
        seeds=tuple(p.seed for p in params),
        steps=tuple(steps),
        all_greedy=all(p.is_greedy for p in params),
        needs_top_k_top_p=any(not p.is_greedy and (p.top_k > 0 or p.top_p < 1.0) for p in params),
        max_logprobs=max(asked) if asked else None,
        grammar=_grammar_masks(seqs),
    )


def _grammar_masks(seqs: list[TokenSequence]) -> GrammarMasks | None:
    rows = [row for row, seq in enumerate(seqs) if seq.grammar is not None]
    if not rows:
        return None
    grammars = [g for g in (seqs[r].grammar for r in rows) if g is not None]
    bitmask = grammars[0].owner.fill_bitmasks(grammars)
    return GrammarMasks(rows=torch.tensor(rows, dtype=torch.int64), bitmask=bitmask)


def _prompt_logprobs(
    out: SchedulerOutput, starts: list[int], first_token: list[int]
) -> PromptLogprobsRequest | None:
    """The prompt positions this step computes whose next prompt token is not scored yet:
    the logits at position p score prompt token p + 1."""
    indices: list[int] = []
    targets: list[int] = []
    spans: list[tuple[int, int, int]] = []
    num_top = 0
    for i, entry in enumerate(out.scheduled):
        seq = entry.seq
        if not seq.needs_prompt_logprobs:
            continue
        # Entry p scores prompt token p; entry 0 (None) is there from the start.
        begin = max(starts[i], len(seq.prompt_logprobs) - 1)
        end = min(starts[i] + entry.num_new_tokens, seq.num_prompt_tokens - 1)
        if begin >= end:
            continue
        offset = first_token[i] - starts[i]
        indices += range(begin + offset, end + offset)
        targets += seq.prompt_token_ids[begin + 1 : end + 1]
        spans.append((i, begin + 1, end - begin))
        num_top = max(num_top, seq.params.prompt_logprobs or 0)
    if not spans:
        return None
    return PromptLogprobsRequest(
        token_indices=torch.tensor(indices, dtype=torch.int64),
        target_ids=torch.tensor(targets, dtype=torch.int64),
        num_top=num_top,
        spans=tuple(spans),
    )


def failing_entries(
    out: SchedulerOutput, block_size: int
) -> list[tuple[ScheduledSequence, Exception]]:
    """The entries of a batch that ``build_forward_input`` cannot build even alone, with why:
    after a batch failed to build, these requests fail and the rest still run."""
    bad = []
    for entry in out.scheduled:
        try:
            build_forward_input(SchedulerOutput(scheduled=[entry]), block_size)
        except Exception as exc:  # noqa: BLE001 - reported to the request
            bad.append((entry, exc))
    return bad
