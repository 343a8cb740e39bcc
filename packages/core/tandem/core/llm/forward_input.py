"""What the engine hands a worker for one step, and what comes back.

Built once per step on the engine thread from the scheduler's decision. In one process the
object itself is handed to every worker (they only read it); across processes it is the unit
that gets serialized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingBatch:
    """Sampling settings of the rows that sample this step, one entry per row."""

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


@dataclass(frozen=True)
class ForwardInput:
    input_ids: torch.Tensor  # [T] tokens of this step, decodes first, then prefill chunks
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] cache slot each token's K/V goes to
    query_lens: torch.Tensor  # [B] new tokens per sequence
    context_lens: torch.Tensor  # [B] tokens in cache per sequence after this step
    block_tables: torch.Tensor  # [B, max_blocks], padded with the null block
    num_decodes: int  # the first num_decodes sequences have exactly one new token
    sample_indices: torch.Tensor  # [S] token indices whose logits are sampled
    sampling: SamplingBatch
    block_size: int

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]  # [S]
    # Filled only when some row asked for logprobs.
    logprobs: list[float] | None = None
    top_token_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
