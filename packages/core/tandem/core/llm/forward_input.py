"""What the engine hands a worker for one step, and what comes back.

Built once per step on the engine thread from the scheduler's decision. In one process the
object itself is handed to every worker (they only read it); across processes it is the unit
that gets serialized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.core.kernels.attention_metadata import AttentionPlan
from tandem.core.llm.logits_processor import BatchUpdate


@dataclass(frozen=True)
class GrammarMasks:
    """The allowed next tokens of the rows under a grammar (structured outputs)."""

    rows: torch.Tensor  # [G] int64 sampling rows
    bitmask: torch.Tensor  # [G, ceil(V / 32)] int32: bit t set = token t allowed


@dataclass(frozen=True)
class DraftRows:
    """Speculative decoding's verify rows: each sampled sequence samples at its last known
    token and at each of its drafts, so the batch has one row per such position."""

    num_drafts: tuple[int, ...]  # [sequences that sample] drafts of each (0: a plain row)
    token_ids: tuple[int, ...]  # [sum(num_drafts)] the drafts, in row order


@dataclass(frozen=True)
class SamplingBatch:
    """Sampling settings of the rows that sample this step, one entry per row (with drafts:
    per sampled position, see ``DraftRows``)."""

    temperatures: torch.Tensor  # [S] float32, 0 = greedy
    top_p: torch.Tensor  # [S] float32
    top_k: torch.Tensor  # [S] int64, 0 = no cut
    # Per-row seed (None = the worker's generator) and how many tokens the row has sampled,
    # so a seeded row draws the same noise whatever else is in the batch.
    seeds: tuple[int | None, ...]
    steps: tuple[int, ...]
    all_greedy: bool
    needs_top_k_top_p: bool
    max_logprobs: int | None
    # None unless some row is under a grammar, so a batch without one pays nothing.
    grammar: GrammarMasks | None = None
    # The logits processors' rows (logits_processor.py): each row's slot (-1: the row uses
    # no processor; None: no row does) and the batch's changes since the last step.
    slots: torch.Tensor | None = None  # [S] int64
    update: BatchUpdate | None = None
    # None unless some row verifies drafts.
    drafts: DraftRows | None = None

    @classmethod
    def uniform(cls, rows: int, temperature: float = 0.0, top_p: float = 1.0) -> SamplingBatch:
        """``rows`` rows sampled alike: one temperature (0 = greedy) and top_p, unseeded, no
        top-k, logprobs or logit edits (what benchmarks and probes run)."""
        return cls(
            temperatures=torch.full((rows,), temperature),
            top_p=torch.full((rows,), top_p),
            top_k=torch.zeros(rows, dtype=torch.int64),
            seeds=(None,) * rows,
            steps=(0,) * rows,
            all_greedy=temperature == 0.0,
            needs_top_k_top_p=top_p < 1.0,
            max_logprobs=None,
        )


@dataclass(frozen=True)
class PromptLogprobsRequest:
    """Prompt positions to score this step: the logits at ``token_indices`` give the logprob
    of ``target_ids``, the prompt token after each."""

    token_indices: torch.Tensor  # [M] int64 indices into the step's tokens
    target_ids: torch.Tensor  # [M] int64
    num_top: int  # top candidates per position (the most any row asked for)
    # (index in the scheduler output, first target's prompt position, count), in order.
    spans: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class StateCopies:
    """Copies around one step of a hybrid model, each (source, destination). Before the
    forward: state rows that roll a sequence back to its last accepted draft (the scratch row
    its state after that position was kept in, into the row that holds its state: speculative
    decoding, first, since a restore may read a row rolled back here), KV blocks (a snapshot's
    partial last block into a sequence's own) and state rows (a snapshot into the slot of a
    sequence starting from it); after it, state rows (a sequence's slot into a new snapshot).
    Snapshots: kv/state_snapshots.py."""

    blocks: tuple[tuple[int, int], ...] = ()
    restores: tuple[tuple[int, int], ...] = ()
    snapshots: tuple[tuple[int, int], ...] = ()
    rollbacks: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class AheadInputs:
    """What a multi-token-prediction head needs of a step besides the model's inputs (its
    input at each token is the token one place ahead): per sequence, the index of its last
    token in the step and the token after it where the host knows it (a prompt going on;
    -1 where it is the one sampled this step); per sequence that samples, in sampling
    order, the index of its last known token (the sampled token follows it, or follows its
    last accepted draft)."""

    last_index: torch.Tensor  # [B] int64
    next_ids: torch.Tensor  # [B] int64
    sampled_after: torch.Tensor  # [S] int64
    # Host only, for the head's drafts after its first (``num_speculative_tokens`` > 1): per
    # sampling sequence, the position of its last known token and its row of block_tables.
    sampled_positions: torch.Tensor | None = None  # [S] int64
    sampled_rows: torch.Tensor | None = None  # [S] int64


@dataclass(frozen=True)
class ForwardInput:
    input_ids: torch.Tensor  # [T] tokens of this step, decodes first, then prefill chunks
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] cache slot each token's K/V goes to
    query_lens: torch.Tensor  # [B] new tokens per sequence
    context_lens: torch.Tensor  # [B] tokens in cache per sequence after this step
    block_tables: torch.Tensor  # [B, max_blocks], padded with the null block
    # [B] linear-attention state slot of each sequence (the null slot 0 for models without
    # linear-attention layers)
    state_slots: torch.Tensor
    num_decodes: int  # the first num_decodes sequences have exactly one new token
    sample_indices: torch.Tensor  # [S] token indices whose logits are sampled
    sampling: SamplingBatch
    block_size: int
    prompt_logprobs: PromptLogprobsRequest | None = None
    state_copies: StateCopies | None = None
    # Speculative decoding on a hybrid model: the sequences right after the decodes that
    # verify drafts, and the scratch rows their linear-attention states after each position
    # but the last are kept in, sequence by sequence ([sum(query_len - 1)] int64).
    num_verifies: int = 0
    verify_scratch: torch.Tensor | None = None
    # Speculative decoding's "mtp" method: the head's inputs (None otherwise).
    ahead: AheadInputs | None = None
    # Set on a worker once a lane has staged the step: the host half of its attention
    # metadata and that half's tensors on the device (never sent between processes).
    staged_attention: tuple[AttentionPlan, tuple[torch.Tensor, ...]] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True)
class PromptLogprobs:
    """The answer to a PromptLogprobsRequest, position by position."""

    logprobs: list[float]  # [M] of each target token
    ranks: list[int]  # [M] 1 = the most likely token
    top_token_ids: list[list[int]]  # [M, num_top]
    top_logprobs: list[list[float]]
    spans: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class SamplerOutput:
    # [S] one per sequence that samples: with drafts, the token after its accepted ones.
    token_ids: list[int]
    # Filled only when some row asked for logprobs.
    logprobs: list[float] | None = None
    top_token_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    # With drafts: how many of each sequence's drafts were accepted (the engine appends
    # that many of them before the sequence's token).
    num_accepted: list[int] | None = None
    # With drafts and logprobs: per sampled sequence, the logprobs of its accepted drafts,
    # one entry per accepted draft as ``logprobs`` / ``top_*`` hold one per sequence.
    accepted_logprobs: list[list[float]] | None = None
    accepted_top_token_ids: list[list[list[int]]] | None = None
    accepted_top_logprobs: list[list[list[float]]] | None = None
    # Rows (of token_ids) whose logits processor raised, each with why: their requests end
    # with that error and nothing sampled for them is used. None when none did.
    failed: dict[int, str] | None = None
    # Speculative decoding's "mtp" method: per sampled sequence, the head's drafts of the
    # tokens after the one sampled, up to ``num_speculative_tokens`` (None: no head).
    draft_token_ids: list[list[int]] | None = None
