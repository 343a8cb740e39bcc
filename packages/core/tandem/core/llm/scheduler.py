"""Continuous batching: waiting and running queues, token and sequence budgets, chunked
prefill, preemption by recomputation. The policy decides; this class holds the state.

A running sequence holds KV blocks and, for hybrid models, one linear-attention state slot:
both are taken at admission (a sequence waits while either is short) and given back together
on finish, abort and preemption."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from tandem.core.config import SchedulerConfig
from tandem.core.kv.block_manager import BlockManager
from tandem.core.kv.state_slots import StateSlotPool
from tandem.core.llm.drafting import Drafter
from tandem.core.llm.scheduling_policy import FcfsPolicy, SchedulingPolicy
from tandem.core.llm.sequence import SequenceStatus, TokenSequence

logger = logging.getLogger(__name__)


@dataclass
class ScheduledSequence:
    seq: TokenSequence
    num_new_tokens: int
    # True when this step computes the sequence's last known token, so it samples one more.
    samples: bool
    # Speculative decoding: tokens proposed after the last known one, computed in this step
    # (counted in num_new_tokens) and verified against the model's own choice at each.
    draft_token_ids: tuple[int, ...] = ()
    # How many of them the verification accepted (set once the step completed).
    num_accepted: int = 0


@dataclass
class SchedulerOutput:
    # Ordered: single-token steps (decodes) first, then multi-token prefill chunks.
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[TokenSequence] = field(default_factory=list)
    # A decode-only batch left out a sequence that had no room for its next block: only the
    # full path, which preempts, can give it one.
    blocked: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        state_slots: StateSlotPool | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        """``state_slots``: the linear-attention state slots of a hybrid model (None: the
        model keeps no per-sequence state); ``drafter``: speculative decoding's (None: off)."""
        self.config = config
        self.drafter = drafter
        self.block_manager = block_manager
        self.state_slots = state_slots
        self.policy: SchedulingPolicy = FcfsPolicy()
        self.waiting: deque[TokenSequence] = deque()
        self.running: list[TokenSequence] = []
        self.num_preemptions = 0

    def add(self, seq: TokenSequence) -> None:
        self.waiting.append(seq)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_tokens_per_batch
        scheduled_ids: set[str] = set()

        # Running sequences first, oldest first, so that preemption takes the newest.
        index = 0
        while index < len(self.running) and budget > 0:
            if len(out.scheduled) >= self.config.max_seqs_per_batch:
                break
            seq = self.running[index]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            drafts = self._drafts(seq, num_new, budget)
            num_new += len(drafts)
            while not self.block_manager.can_append(seq, num_new):
                candidates = [s for s in self.running if s.request_id not in scheduled_ids]
                victim = self.policy.preemption_victim(candidates)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # seq preempted itself; the entry at ``index`` is now another one
            self.block_manager.append_slots(seq, num_new)
            out.scheduled.append(self._entry(seq, num_new, drafts))
            scheduled_ids.add(seq.request_id)
            budget -= num_new
            index += 1

        # Admit waiting sequences only when nothing had to be preempted this step.
        while self.waiting and budget > 0 and not out.preempted:
            if len(out.scheduled) >= self.config.max_seqs_per_batch:
                break
            seq = self.waiting[0]
            # Prompt logprobs need the logits of every prompt position: no cache hits.
            cached = [] if seq.needs_prompt_logprobs else self.block_manager.find_cached_prefix(seq)
            remaining = seq.num_tokens - len(cached) * self.block_manager.block_size
            # Without chunking, an oversized sequence may still run alone: only a preempted
            # one can be (its generated tokens grew it past the budget), and waiting for a
            # budget it can never fit would stall it forever.
            if (
                remaining > budget
                and not self.config.enable_chunked_prefill
                and (out.scheduled or remaining <= self.config.max_tokens_per_batch)
            ):
                break
            num_new = min(remaining, budget) if self.config.enable_chunked_prefill else remaining
            if not self.block_manager.can_allocate(seq, num_new, cached):
                break
            # One slot is all a sequence ever needs, and running ones give theirs back as
            # they end: without a free one it waits, like a sequence short of blocks.
            if self.state_slots is not None and not self.state_slots.assign(seq):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq, num_new, cached)
            if seq.num_preemptions == 0:
                seq.num_cached_prompt_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            out.scheduled.append(self._entry(seq, num_new))
            budget -= num_new

        out.scheduled.sort(key=lambda s: s.num_new_tokens != 1)
        return out

    def schedule_decodes(self, exclude: set[str], max_seqs: int) -> SchedulerOutput:
        """A decode-only batch while other steps are in flight: running sequences not in
        ``exclude`` that have exactly one token to compute, oldest first, at most
        ``max_seqs``. Nothing is admitted or preempted (an in-flight step may hold what a
        preemption would free); a sequence without room for its next block waits, and the
        batch says so (``blocked``)."""
        out = SchedulerOutput()
        limit = min(max_seqs, self.config.max_seqs_per_batch, self.config.max_tokens_per_batch)
        for seq in self.running:
            if len(out.scheduled) >= limit:
                break
            if seq.request_id in exclude or seq.num_tokens - seq.num_computed_tokens != 1:
                continue
            if not self.block_manager.can_append(seq, 1):
                out.blocked = True
                continue
            self.block_manager.append_slots(seq, 1)
            out.scheduled.append(self._entry(seq, 1))
        return out

    def decodes_fit(self) -> bool:
        """Whether the free blocks cover every running sequence's next token."""
        blocks = self.block_manager
        needed = sum(
            max(0, blocks.blocks_for(s.num_computed_tokens + 1) - len(s.block_table))
            for s in self.running
        )
        return needed <= blocks.num_free_blocks

    def needs_full_step(self) -> bool:
        """Whether some work is more than one decode token per running sequence (admissions,
        prefill chunks): such a step runs with nothing else in flight."""
        return bool(self.waiting) or any(
            s.num_tokens - s.num_computed_tokens != 1 for s in self.running
        )

    def _entry(
        self, seq: TokenSequence, num_new: int, drafts: tuple[int, ...] = ()
    ) -> ScheduledSequence:
        return ScheduledSequence(
            seq=seq,
            num_new_tokens=num_new,
            samples=seq.num_computed_tokens + num_new - len(drafts) == seq.num_tokens,
            draft_token_ids=drafts,
        )

    def _drafts(self, seq: TokenSequence, num_new: int, budget: int) -> tuple[int, ...]:
        """Draft tokens for a decode (one token to compute), if the KV blocks they need are
        free: drafts never cause a preemption (without them the step is still whole)."""
        if self.drafter is None or num_new != 1:
            return ()
        drafts = self.drafter.drafts(seq, budget)
        if drafts and not self.block_manager.can_append(seq, 1 + len(drafts)):
            return ()
        return drafts

    def _preempt(self, seq: TokenSequence) -> None:
        logger.info("preempting request %s (recompute later): out of KV blocks", seq.request_id)
        self.running.remove(seq)
        # The state slot goes too: the recompute starts from a zero state, in any slot.
        self.release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(self.policy.resume_position(self.waiting, seq), seq)

    def on_step_done(self, out: SchedulerOutput) -> None:
        """Advance every scheduled sequence past the tokens the step computed."""
        for entry in out.scheduled:
            seq = entry.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # finished or aborted while the step ran
            rejected = len(entry.draft_token_ids) - entry.num_accepted
            # Only verified tokens count as computed (and may enter the prefix cache); the
            # KV written at rejected positions is overwritten by later steps.
            seq.num_computed_tokens += entry.num_new_tokens - rejected
            if rejected:
                # Blocks taken only for rejected positions go back (the next token's stays).
                self.block_manager.trim(seq, seq.num_computed_tokens + 1)
            self.block_manager.cache_computed_blocks(seq)

    def release(self, seq: TokenSequence) -> None:
        """Give back ``seq``'s KV blocks and state slot."""
        self.block_manager.free(seq)
        if self.state_slots is not None:
            self.state_slots.release(seq)

    def finish(
        self, seq: TokenSequence, reason: str, error: str | None = None, free_now: bool = True
    ) -> None:
        """Take ``seq`` out of the queues, free its blocks and state slot (unless a step
        still in flight writes them: the caller releases them when it completes) and mark it
        finished."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if free_now:
            self.release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        seq.metrics.finished_time = time.monotonic()
