"""What the recommendation engine hands a worker for one step of a batch, and what comes back.

A batch is a group of requests that go through one prefill (round 0: encode the histories,
keep their cross-attention keys in the batch's blocks, emit level 0) and then exactly
``max_decode_rounds`` decode rounds (one level each) together, all on one pipeline lane.
Steps own their tensors: the engine builds them from copies and never touches them again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RecPrefill:
    histories: torch.Tensor  # [R, L, C] int64, padded with 0 past each length
    lengths: torch.Tensor  # [R] items per history
    block_tables: torch.Tensor  # [R, blocks] int64, padded with the null block
    beam_widths: torch.Tensor  # [R] int64
    num_candidates: tuple[int, ...]


@dataclass(frozen=True)
class RecStep:
    batch_id: int
    round: int  # 0 = prefill
    prefill: RecPrefill | None = None


@dataclass(frozen=True)
class RecStepOutput:
    batch_id: int
    round: int
    finished: bool
    # Filled by the last round: per request, ranked item tuples and their scores.
    candidates: list[list[tuple[int, ...]]] | None = None
    scores: list[list[float]] | None = None
