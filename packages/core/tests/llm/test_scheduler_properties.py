"""Property tests of the LLM scheduler over a real block manager (prefix cache on): random
sequences of arrivals, steps (full and decode-only), aborts and finishes keep the queues and
the KV accounting consistent: every unfinished request is in exactly one queue, a waiting
(or preempted) one holds no blocks, a running one has room for what it computed, reference
counts match the block tables, a step stays within its budgets, and once everything is
done every block is free. Requests that fit the pool always make progress."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tandem.core.config import SchedulerConfig
from tandem.core.kv.block_manager import BlockManager
from tandem.core.llm.sampling_params import SamplingParams
from tandem.core.llm.scheduler import Scheduler, SchedulerOutput
from tandem.core.llm.sequence import SequenceStatus, TokenSequence

from ..kv.pool_invariants import check_hash_chain, check_pool

BLOCK_SIZE = 2
NUM_BLOCKS = 10
MAX_TOKENS = 4
BUDGET = 6
MAX_SEQS = 3


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_cache=True)
        self.scheduler = Scheduler(
            SchedulerConfig(max_tokens_per_batch=BUDGET, max_seqs_per_batch=MAX_SEQS),
            self.blocks,
        )
        self.unfinished: dict[str, TokenSequence] = {}
        self.count = 0

    # Prompts whose whole life (prompt + MAX_TOKENS - 1 cached) fits the pool alone.
    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=10))
    def arrive(self, prompt: list[int]) -> None:
        self.count += 1
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        seq = TokenSequence(f"r{self.count}", prompt, params, frozenset(), 10_000)
        self.unfinished[seq.request_id] = seq
        self.scheduler.add(seq)

    def _run(self, out: SchedulerOutput, token: int) -> None:
        assert out.num_tokens <= BUDGET and len(out.scheduled) <= MAX_SEQS
        names = [e.seq.request_id for e in out.scheduled]
        assert len(names) == len(set(names)), "a sequence scheduled twice in one step"
        for entry in out.scheduled:
            seq = entry.seq
            assert seq.status is SequenceStatus.RUNNING
            end = seq.num_computed_tokens + entry.num_new_tokens
            assert end <= seq.num_tokens
            assert len(seq.block_table) * BLOCK_SIZE >= end, "scheduled past its blocks"
        self.scheduler.on_step_done(out)
        for entry in out.scheduled:
            seq = entry.seq
            if not entry.samples:
                continue
            seq.token_ids.append(token)
            if seq.num_output_tokens >= MAX_TOKENS:
                self.scheduler.finish(seq, "length")
                del self.unfinished[seq.request_id]

    @rule(token=st.integers(0, 2))
    def full_step(self, token: int) -> None:
        out = self.scheduler.schedule()
        waiting_before = self.scheduler.num_waiting
        if out.is_empty() and not out.preempted and self.unfinished:
            # Nothing ran and nothing was preempted: only possible with nothing running and
            # the head waiting for blocks it can never get, which cannot be here.
            raise AssertionError(f"no progress: {waiting_before} waiting, none running")
        self._run(out, token)

    @precondition(lambda self: bool(self.scheduler.running))
    @rule(token=st.integers(0, 2), width=st.integers(1, 3))
    def decode_step(self, token: int, width: int) -> None:
        out = self.scheduler.schedule_decodes(exclude=set(), max_seqs=width)
        assert not out.preempted
        assert all(e.num_new_tokens == 1 for e in out.scheduled)
        self._run(out, token)

    @precondition(lambda self: bool(self.unfinished))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.unfinished)))
        seq = self.unfinished.pop(name)
        self.scheduler.finish(seq, "abort")
        assert seq.block_table == [] and seq.status is SequenceStatus.FINISHED

    @invariant()
    def consistent(self) -> None:
        running = {s.request_id for s in self.scheduler.running}
        waiting = {s.request_id for s in self.scheduler.waiting}
        assert not running & waiting, f"in both queues: {running & waiting}"
        assert running | waiting == set(self.unfinished), "a request left the queues"
        for seq in self.scheduler.waiting:
            assert seq.block_table == [], f"waiting {seq.request_id} holds blocks"
            assert seq.num_computed_tokens == 0
        for seq in self.scheduler.running:
            assert len(seq.block_table) * BLOCK_SIZE >= seq.num_computed_tokens
            check_hash_chain(
                self.blocks, seq.token_ids, seq.block_table, seq.block_hashes,
                seq.num_computed_tokens,
            )  # fmt: skip
        check_pool(self.blocks, [s.block_table for s in self.scheduler.running])

    def teardown(self) -> None:
        # Everything still there runs to its end: no request is stuck.
        for _ in range(500):
            if not self.unfinished:
                break
            self.full_step(token=1)
        assert not self.unfinished, f"stuck: {sorted(self.unfinished)}"
        check_pool(self.blocks, [])
        assert self.blocks.num_free_blocks == NUM_BLOCKS


SchedulerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestScheduler = SchedulerMachine.TestCase
