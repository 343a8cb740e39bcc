"""A request's state as it moves through the scheduler: tokens, progress, blocks, metrics."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.core.kv.state_snapshots import Snapshot
from tandem.core.llm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.core.llm.structured_output import GrammarState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class TokenLogprobs:
    """The chosen token's logprob and the top candidates at one position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    # 1 = the most likely token (kept for prompt tokens, which vLLM reports with their rank).
    rank: int | None = None


@dataclass
class TokenSequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    # Generation stops here whatever max_tokens says: the model's context is full.
    max_total_tokens: int
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Prefix-cache hash of each full block of token_ids, filled as blocks become full.
    block_hashes: list[int] = field(default_factory=list)
    # Linear-attention state slot (hybrid models), held from admission to the end; 0 = none.
    state_slot: int = 0
    # Hybrid prefix caching (kv/state_snapshots.py): the snapshot the step in flight starts
    # this sequence from, and the one it writes; the position where the next prefill chunk
    # ends for a snapshot (0: none planned), and where the last snapshot was taken or restored.
    pending_restore: Snapshot | None = None
    pending_snapshot: Snapshot | None = None
    snapshot_cut: int = 0
    last_snapshot_at: int = 0
    # Its last snapshot inside a long prefill: the next one supersedes it.
    interval_snapshot: Snapshot | None = None
    # Speculative decoding's "mtp" method: the head's drafts of the tokens after the last
    # one, made when the sequence had ``head_drafts_at`` tokens (stale once it has more).
    head_drafts: tuple[int, ...] = ()
    head_drafts_at: int = -1
    # Hybrid models with speculative decoding: the run of scratch state rows its verify
    # steps keep their states in, held from admission to the end; -1 = none.
    scratch_run: int = -1
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    error: str | None = None
    # The request field whose content the engine could not serve (its grammar went past the
    # grammar engine's limits mid-output): the client's input failed, not the engine.
    error_param: str | None = None
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # One entry per prompt token once scored; the first token has nothing before it (None).
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # The request's grammar (structured outputs).
    grammar: GrammarState | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs = [None]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and some prompt tokens are not scored yet."""
        return (
            self.params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.num_prompt_tokens
        )

    @property
    def max_output_tokens(self) -> int:
        return min(self.params.max_tokens, self.max_total_tokens - self.num_prompt_tokens)

    def check_stop_token(self) -> str | None:
        """Finish reason implied by the newest token and the length limits, if any."""
        last = self.token_ids[-1]
        # The sampler keeps stop tokens out until min_tokens; a grammar can still force one.
        may_stop = self.num_output_tokens > self.params.min_tokens
        if may_stop and not self.params.ignore_eos and last in self.eos_token_ids:
            return "stop"
        if may_stop and last in self.params.stop_token_ids:
            return "stop"
        if self.num_output_tokens >= self.max_output_tokens:
            return "length"
        return None
