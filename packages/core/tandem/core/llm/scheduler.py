"""Continuous batching: waiting and running queues, token and sequence budgets, chunked
prefill, preemption by recomputation. The policy decides; this class holds the state.

A running sequence holds KV blocks and, for hybrid models, one linear-attention state slot:
both are taken at admission (a sequence waits while either is short) and given back together
on finish, abort and preemption.

Prefix caching of hybrid models needs a state snapshot where the cached prefix ends
(kv/state_snapshots.py). This class decides where they are taken, at no cost per token:
 * at the end of every prompt, copied from the slot after the step that completes it (the
   start of a follow-up turn, or of the same prompt again);
 * when a sequence ends (or is preempted), its slot itself becomes the snapshot, exchanged for
   a free row without a copy: a follow-up turn that repeats the answer starts after it;
 * where the prefix cache shows that a sequence shares more of its prompt with earlier ones
   than any snapshot covers (a shared system prompt): its prefill chunk is cut there, one step
   more for this sequence, so that every later one skips the shared part;
 * at the end of a prefill chunk at least ``snapshot_interval`` tokens past the last snapshot
   (long prompts, chunked anyway by the token budget), each superseding the sequence's
   previous one (it goes first when rows run out).
A sequence that starts from a snapshot gets the snapshot's row copied into its slot (and the
snapshot's partial last KV block into its own) before its first step runs."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from tandem.core.config import SchedulerConfig
from tandem.core.kv.block_manager import BlockManager
from tandem.core.kv.state_slots import NULL_STATE_SLOT, StateSlotPool
from tandem.core.kv.state_snapshots import Snapshot, StateSnapshotCache
from tandem.core.llm.drafting import Drafter
from tandem.core.llm.scheduling_policy import FcfsPolicy, SchedulingPolicy
from tandem.core.llm.sequence import SequenceStatus, TokenSequence

logger = logging.getLogger(__name__)

# A shared prefix found in the KV cache beyond every snapshot is cut out of a prefill (one step
# more) only when the snapshot taken there skips at least this many tokens for later requests:
# below it, recomputing them costs less than the extra step's fixed cost.
MIN_CUT_TOKENS = 64
# Finish reasons after which a sequence's state is worth keeping (an abort or an error is not
# followed by a turn that continues the answer).
_KEPT_ON = frozenset({"stop", "length", "preempted"})


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
    # Hybrid models: the scratch rows the linear-attention state after each of the step's
    # positions but the last is kept in (one per draft), to roll back to.
    scratch_rows: tuple[int, ...] = ()
    # Hybrid prefix caching: before the step, the snapshot row copied into the sequence's
    # slot and a KV block copied into its own (source, destination); after it, the row its
    # slot is copied to.
    restore_row: int | None = None
    copy_block: tuple[int, int] | None = None
    snapshot_row: int | None = None


@dataclass(frozen=True)
class CachedStart:
    """Where a waiting sequence starts: cached blocks, the tokens they and a snapshot cover,
    the snapshot, and where its prefill is to be cut for a new one (0: nowhere)."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    snapshot: Snapshot | None = None
    cut: int = 0


@dataclass
class SchedulerOutput:
    # Ordered: single-token steps (decodes) first, then multi-token prefill chunks.
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[TokenSequence] = field(default_factory=list)
    # A decode-only batch left out a sequence that had no room for its next block: only the
    # full path, which preempts, can give it one.
    blocked: bool = False
    # Hybrid models with speculative decoding: state rows to copy before this step's forward
    # (scratch row, the row holding a sequence's state) that undo rejected drafts.
    rollbacks: list[tuple[int, int]] = field(default_factory=list)
    # The requests those rollbacks belong to: no other step may read or write their rows
    # until this one has run (pipeline lanes run steps at once).
    rollback_ids: set[str] = field(default_factory=set)

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
        snapshots: StateSnapshotCache | None = None,
        snapshot_interval: int = 512,
        state_scratch: range | None = None,
    ) -> None:
        """``state_slots``: the linear-attention state slots of a hybrid model (None: the
        model keeps no per-sequence state); ``drafter``: speculative decoding's (None: off);
        ``snapshots``: the state snapshots of a hybrid model's prefix cache (None: off);
        ``state_scratch``: with both a drafter and state slots, the state rows that keep
        verifying sequences' states position by position (``num_speculative_tokens`` per
        slot)."""
        self.config = config
        self.drafter = drafter
        self.state_scratch = state_scratch
        if drafter is not None and state_slots is not None:
            per_slot = drafter.config.num_speculative_tokens
            if state_scratch is None or len(state_scratch) < per_slot * state_slots.num_slots:
                raise ValueError(
                    f"speculative decoding on a hybrid model needs {per_slot} scratch state "
                    f"rows per slot ({state_slots.num_slots} slots), got {state_scratch}"
                )
        # Rollbacks of the last step's rejected drafts, for the next step to run first.
        self._rollbacks: list[tuple[int, int]] = []
        self._rollback_ids: set[str] = set()
        # Runs of scratch rows, one per sequence from admission to its end (not per step:
        # steps in flight at once on pipeline lanes must not share them).
        self._free_runs: deque[int] | None = None
        if drafter is not None and state_slots is not None:
            self._free_runs = deque(range(state_slots.num_slots))
        self.block_manager = block_manager
        self.state_slots = state_slots
        self.snapshots = snapshots
        self.snapshot_interval = snapshot_interval
        # Prompt tokens looked up in the prefix cache at admission, and those found (vLLM's
        # prefix_cache_queries and prefix_cache_hits); for hybrid models, snapshot lookups.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.snapshot_queries = 0
        self.snapshot_hits = 0
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
            num_new = self._cut(seq, min(seq.num_tokens - seq.num_computed_tokens, budget))
            drafts = self._drafts(seq, num_new, budget)
            num_new += len(drafts)
            while not self._room(partial(self.block_manager.append_deficit, seq, num_new)):
                candidates = [s for s in self.running if s.request_id not in scheduled_ids]
                victim = self.policy.preemption_victim(candidates)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # seq preempted itself; the entry at ``index`` is now another one
            self.block_manager.append_slots(seq, num_new)
            entry = self._entry(seq, num_new, drafts)
            self._plan_snapshot(entry)
            out.scheduled.append(entry)
            scheduled_ids.add(seq.request_id)
            budget -= num_new
            index += 1

        # Admit waiting sequences only when nothing had to be preempted this step.
        while self.waiting and budget > 0 and not out.preempted:
            if len(out.scheduled) >= self.config.max_seqs_per_batch:
                break
            seq = self.waiting[0]
            start = self._cached_start(seq)
            remaining = seq.num_tokens - start.num_tokens
            # Without chunking, an oversized sequence may still run alone: only a preempted
            # one can be (its generated tokens grew it past the budget), and waiting for a
            # budget it can never fit would stall it forever.
            if (
                remaining > budget
                and not self.config.enable_chunked_prefill
                and (out.scheduled or remaining <= self.config.max_tokens_per_batch)
            ):
                self._unpin(start)
                break
            num_new = min(remaining, budget) if self.config.enable_chunked_prefill else remaining
            if start.cut:
                num_new = min(num_new, start.cut - start.num_tokens)
            # One slot is all a sequence ever needs, and running ones give theirs back as
            # they end: without a free one it waits, like a sequence short of blocks.
            slots = self.state_slots
            deficit = partial(
                self.block_manager.allocate_deficit, seq, num_new, start.blocks, start.num_tokens
            )
            if (slots is not None and slots.num_free == 0) or not self._room(deficit):
                self._unpin(start)
                break
            if slots is not None:
                slots.assign(seq)
            if self._free_runs is not None:
                # As many runs as slots, and a sequence holds both: one is free.
                seq.scratch_run = self._free_runs.popleft()
            self.waiting.popleft()
            self.block_manager.allocate(seq, num_new, start.blocks, start.num_tokens)
            self._count_lookup(seq, start)
            if seq.num_preemptions == 0:
                seq.num_cached_prompt_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            entry = self._entry(seq, num_new)
            if start.snapshot is not None:
                self._restore(entry, start)
            seq.snapshot_cut = start.cut
            seq.last_snapshot_at = start.num_tokens
            self._plan_snapshot(entry)
            out.scheduled.append(entry)
            budget -= num_new

        self._reserve_lookahead(out)
        # Decodes, then sequences verifying drafts, then prefill chunks (the layout the
        # linear-attention layers of hybrid models read, linear_attention_metadata.py).
        out.scheduled.sort(
            key=lambda s: 0 if s.num_new_tokens == 1 else 2 - bool(s.draft_token_ids)
        )
        self._give_scratch(out)
        if out.scheduled:
            self.take_rollbacks(out)
        return out

    def _give_scratch(self, out: SchedulerOutput) -> None:
        """Scratch rows for the states of the verifying sequences of a hybrid model: each
        sequence's own run of ``num_speculative_tokens`` rows. A run is written only by its
        sequence's steps and read by the rollback after one, which runs before anything else
        in the next step that carries it; a sequence whose rollback a step in flight carries
        is busy until it completes, and a run given to a new sequence is first written in a
        step after its admission, which carried every rollback pending then."""
        if self._free_runs is None or self.drafter is None or self.state_scratch is None:
            return
        per_slot = self.drafter.config.num_speculative_tokens
        for entry in out.scheduled:
            if entry.draft_token_ids:
                first = self.state_scratch[entry.seq.scratch_run * per_slot]
                entry.scratch_rows = tuple(range(first, first + len(entry.draft_token_ids)))

    def take_rollbacks(self, out: SchedulerOutput) -> None:
        """Hand the pending rollbacks to ``out``, the next step to run."""
        out.rollbacks, self._rollbacks = self._rollbacks + out.rollbacks, []
        out.rollback_ids, self._rollback_ids = self._rollback_ids | out.rollback_ids, set()

    def return_rollbacks(self, out: SchedulerOutput) -> None:
        """Take back the rollbacks of ``out``, a step that will not run."""
        self._rollbacks, out.rollbacks = out.rollbacks + self._rollbacks, []
        self._rollback_ids, out.rollback_ids = out.rollback_ids | self._rollback_ids, set()

    def schedule_decodes(self, exclude: set[str], max_seqs: int) -> SchedulerOutput:
        """A decode-only batch while other steps are in flight: running sequences not in
        ``exclude`` that have exactly one token to compute, oldest first, at most
        ``max_seqs``, with their drafts where speculating. Nothing is admitted or preempted
        (an in-flight step may hold what a preemption would free); a sequence without room
        for its next block waits, and the batch says so (``blocked``)."""
        out = SchedulerOutput()
        budget = self.config.max_tokens_per_batch
        limit = min(max_seqs, self.config.max_seqs_per_batch)
        for seq in self.running:
            if len(out.scheduled) >= limit or budget <= 0:
                break
            if seq.request_id in exclude or seq.num_tokens - seq.num_computed_tokens != 1:
                continue
            if not self._room(partial(self.block_manager.append_deficit, seq, 1)):
                out.blocked = True
                continue
            # Only with their blocks free (_drafts): the single token's room is enough.
            drafts = self._drafts(seq, 1, budget)
            self.block_manager.append_slots(seq, 1 + len(drafts))
            out.scheduled.append(self._entry(seq, 1 + len(drafts), drafts))
            budget -= 1 + len(drafts)
        self._reserve_lookahead(out)
        # Decodes before sequences verifying drafts, as in schedule().
        out.scheduled.sort(key=lambda s: bool(s.draft_token_ids))
        self._give_scratch(out)
        if out.scheduled:
            self.take_rollbacks(out)
        return out

    def decodes_fit(self) -> bool:
        """Whether the free blocks cover every running sequence's next token."""
        blocks = self.block_manager
        needed = sum(
            max(0, blocks.blocks_for(s.num_computed_tokens + 1) - len(s.block_table))
            for s in self.running
        )
        if needed <= blocks.num_free_blocks:
            return True
        # Blocks only state snapshots hold are taken back when a decode needs them.
        freeable = self.snapshots.freeable_blocks() if self.snapshots is not None else 0
        return needed <= blocks.num_free_blocks + freeable

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

    def _room(self, deficit: Callable[[], int]) -> bool:
        """Whether the blocks ``deficit()`` says are missing (0 or less: none) can be made
        free, by dropping state snapshots for the KV blocks only they hold: running and
        waiting sequences come before cached states. Asked again after each drop: a freed
        block may be one of the sequence's own cache hits, which frees nothing for it."""
        missing = deficit()
        while missing > 0:
            if self.snapshots is None or not self.snapshots.free_blocks(missing):
                return False
            missing = deficit()
        return True

    def _cached_start(self, seq: TokenSequence) -> CachedStart:
        """Where a waiting ``seq`` can start; a snapshot found is pinned (``_unpin`` if the
        sequence is not admitted after all)."""
        # Prompt logprobs need the logits of every prompt position: no cache hits.
        if seq.needs_prompt_logprobs:
            return CachedStart()
        blocks, hashes = self.block_manager.cached_prefix(seq)
        bs = self.block_manager.block_size
        if self.snapshots is None:
            return CachedStart(blocks, len(blocks) * bs)
        # Cached KV alone skips nothing in a hybrid model: only up to a snapshot.
        snap = self.snapshots.lookup(seq.token_ids, hashes, limit=seq.num_tokens - 1)
        start = 0 if snap is None else snap.num_tokens
        shared = len(blocks) * bs
        worth = self.config.enable_chunked_prefill and shared - start >= MIN_CUT_TOKENS
        # Another sequence admitted a step earlier may be writing that snapshot already.
        cut = shared if worth and not self.snapshots.holds(hashes[-1], ()) else 0
        return CachedStart(blocks[: start // bs], start, snap, cut)

    def _unpin(self, start: CachedStart) -> None:
        if start.snapshot is not None and self.snapshots is not None:
            self.snapshots.unpin(start.snapshot)

    def _count_lookup(self, seq: TokenSequence, start: CachedStart) -> None:
        if seq.needs_prompt_logprobs or not self.block_manager.enable_prefix_cache:
            return
        self.prefix_cache_queries += seq.num_tokens
        self.prefix_cache_hits += start.num_tokens
        if self.snapshots is not None:
            self.snapshot_queries += 1
            self.snapshot_hits += start.snapshot is not None

    def _restore(self, entry: ScheduledSequence, start: CachedStart) -> None:
        """Start ``entry``'s sequence from ``start``'s snapshot: its row into the slot, and its
        partial last block into the sequence's first new block, before the step runs."""
        snap = start.snapshot
        assert snap is not None
        seq = entry.seq
        entry.restore_row = snap.row
        if snap.tail_block is not None:
            entry.copy_block = (snap.tail_block, seq.block_table[len(start.blocks)])
        seq.pending_restore = snap

    def _cut(self, seq: TokenSequence, num_new: int) -> int:
        """``num_new`` tokens from the sequence's next one, ending at its planned snapshot."""
        cut = seq.snapshot_cut
        if cut > seq.num_computed_tokens:
            return min(num_new, cut - seq.num_computed_tokens)
        return num_new

    def _plan_snapshot(self, entry: ScheduledSequence) -> None:
        """Have the step copy the sequence's state to a new snapshot after it runs, where the
        chunk it computes ends at a place the class docstring names."""
        seq = entry.seq
        # A verify step's slot holds the state after its drafts too, rejected ones included.
        if self.snapshots is None or seq.pending_snapshot is not None or entry.draft_token_ids:
            return
        end = seq.num_computed_tokens + entry.num_new_tokens - len(entry.draft_token_ids)
        if end <= seq.last_snapshot_at:
            return
        planned = end == seq.snapshot_cut
        every = self.snapshot_interval
        interval = 0 < every <= end - seq.last_snapshot_at and end < seq.num_tokens
        if not (planned or interval or end == seq.num_prompt_tokens):
            return
        if planned:
            seq.snapshot_cut = 0
        snap = self.snapshots.reserve(end, *self._snapshot_key(seq, end))
        if snap is None:
            return
        entry.snapshot_row = snap.row
        seq.pending_snapshot = snap
        seq.last_snapshot_at = end
        if not (planned or end == seq.num_prompt_tokens):
            # Inside a long prefill only the latest is worth a row: one prompt's many
            # snapshots must not push out everybody else's.
            if seq.interval_snapshot is not None:
                self.snapshots.demote(seq.interval_snapshot)
            seq.interval_snapshot = snap

    def _snapshot_key(
        self, seq: TokenSequence, end: int
    ) -> tuple[int | None, tuple[int, ...], int | None]:
        """What names ``seq``'s first ``end`` tokens among snapshots: the chain hash of their
        last full block, the tokens after it, and the block holding those (a reference taken,
        which the snapshot keeps)."""
        blocks = self.block_manager
        full = end // blocks.block_size
        hashes = blocks.prefix_hashes(seq, full)
        tail = tuple(seq.token_ids[full * blocks.block_size : end])
        tail_block = seq.block_table[full] if tail else None
        if tail_block is not None:
            blocks.hold(tail_block)
        return (hashes[-1] if hashes else None), tail, tail_block

    def _keep_state(self, seq: TokenSequence, reason: str) -> None:
        """Make a running sequence's slot, at its end, a snapshot of everything it computed
        (its blocks are published already), exchanging it for a free row."""
        slots = self.state_slots
        if (
            self.snapshots is None
            or slots is None
            or reason not in _KEPT_ON
            or seq.status is not SequenceStatus.RUNNING
            or seq.state_slot == NULL_STATE_SLOT
            or seq.num_computed_tokens <= seq.last_snapshot_at
        ):
            return
        end = seq.num_computed_tokens
        parent, tail, tail_block = self._snapshot_key(seq, end)
        given = self.snapshots.adopt(seq.state_slot, end, parent, tail, tail_block)
        if given is not None:
            slots.exchange(seq, given)
        elif tail_block is not None:
            self.block_manager.release_block(tail_block)

    def _settle(self, seq: TokenSequence, written: bool) -> None:
        """The step that was to read and write ``seq``'s snapshots ran (``written``: and the
        sequence goes on, its blocks published), or never will."""
        snapshots = self.snapshots
        if snapshots is None:
            return
        if seq.pending_restore is not None:
            snapshots.unpin(seq.pending_restore)
            seq.pending_restore = None
        if seq.pending_snapshot is not None:
            snapshots.complete(seq.pending_snapshot, written)
            seq.pending_snapshot = None

    def _drafts(self, seq: TokenSequence, num_new: int, budget: int) -> tuple[int, ...]:
        """Draft tokens for a decode (one token to compute), if the KV blocks they need are
        free: drafts never cause a preemption (without them the step is still whole). Not
        for a one-token chunk of a prefill (a cut short of a snapshot): its step samples
        nothing, so there is nothing to verify a draft against."""
        if self.drafter is None or num_new != 1 or seq.num_tokens - seq.num_computed_tokens != 1:
            return ()
        drafts = self.drafter.drafts(seq, budget)
        if drafts and not self.block_manager.can_append(seq, 1 + len(drafts)):
            return ()
        return drafts

    def _reserve_lookahead(self, out: SchedulerOutput) -> None:
        """Blocks for a multi-token-prediction head's drafts after its first: the head
        writes its KV at up to ``num_speculative_tokens - 1`` positions past the step's
        last token (``ModelRunner._later_drafts``). Taken once the step is scheduled, from
        blocks still free, so that they never cost a preemption or an admission; a sequence
        left without them drafts fewer tokens. No further than the request may emit."""
        drafter = self.drafter
        if drafter is None or not drafter.config.drafts_with_head:
            return
        lookahead = drafter.config.num_speculative_tokens - 1
        for entry in out.scheduled:
            seq = entry.seq
            extra = min(lookahead, seq.max_output_tokens - seq.num_output_tokens - 1)
            wanted = entry.num_new_tokens + extra
            if entry.samples and extra > 0 and self.block_manager.can_append(seq, wanted):
                self.block_manager.append_slots(seq, wanted)

    def _preempt(self, seq: TokenSequence) -> None:
        logger.info("preempting request %s (recompute later): out of KV blocks", seq.request_id)
        self._keep_state(seq, "preempted")
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
            self._settle(seq, written=seq.status is SequenceStatus.RUNNING)
            if seq.status is not SequenceStatus.RUNNING:
                continue  # finished or aborted while the step ran
            rejected = len(entry.draft_token_ids) - entry.num_accepted
            # Only verified tokens count as computed (and may enter the prefix cache); the
            # KV written at rejected positions is overwritten by later steps.
            seq.num_computed_tokens += entry.num_new_tokens - rejected
            if rejected and entry.scratch_rows:
                # The linear-attention state goes back to the one after the last accepted
                # position (kept in a scratch row), before anything reads the sequence's row
                # again: the next step's forward, whichever sequence or snapshot holds it then.
                self._rollbacks.append((entry.scratch_rows[entry.num_accepted], seq.state_slot))
                self._rollback_ids.add(seq.request_id)
            if rejected:
                # Blocks taken only for rejected positions go back (the next token's stays).
                self.block_manager.trim(seq, seq.num_computed_tokens + 1)
            self.block_manager.cache_computed_blocks(seq)

    def release(self, seq: TokenSequence) -> None:
        """Give back ``seq``'s KV blocks and state slot."""
        self.block_manager.free(seq)
        if self.state_slots is not None:
            self.state_slots.release(seq)
        if self._free_runs is not None and seq.scratch_run >= 0:
            self._free_runs.append(seq.scratch_run)
            seq.scratch_run = -1

    def finish(
        self, seq: TokenSequence, reason: str, error: str | None = None, free_now: bool = True
    ) -> None:
        """Take ``seq`` out of the queues, free its blocks and state slot (unless a step
        still in flight writes them: the caller releases them when it completes) and mark it
        finished."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if free_now:
            # A step with its snapshots that has not completed never will.
            self._settle(seq, written=False)
            self._keep_state(seq, reason)
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
