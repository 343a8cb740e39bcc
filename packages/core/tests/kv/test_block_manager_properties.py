"""Property tests of the block manager and its prefix cache: random sequences of admitting
(with prefix hits), computing, growing, preempting, finishing, reserving and releasing keep
reference counts, the free list and the hash chains consistent, never lose or double-free a
block, and a prefix hit always returns blocks holding exactly the tokens asked for."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from tandem.core.kv.block_manager import BlockManager
from tandem.core.llm.sampling_params import SamplingParams
from tandem.core.llm.sequence import TokenSequence

from .pool_invariants import check_hash_chain, check_pool

BLOCK_SIZE = 2
NUM_BLOCKS = 12
# Few distinct tokens: prompts share prefixes often.
TOKENS = st.lists(st.integers(min_value=0, max_value=2), min_size=1, max_size=9)


class BlockManagerMachine(RuleBasedStateMachine):
    sequences = Bundle("sequences")
    reservations = Bundle("reservations")

    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_cache=True)
        self.live: dict[str, TokenSequence] = {}
        self.reserved: dict[int, list[int]] = {}
        # What each block holds once a sequence computed it full: prefix hits must match.
        self.content: dict[int, tuple[int, ...]] = {}
        self.count = 0

    def _new(self, tokens: list[int]) -> TokenSequence:
        self.count += 1
        return TokenSequence(f"s{self.count}", tokens, SamplingParams(), frozenset(), 10_000)

    def _record_content(self, seq: TokenSequence) -> None:
        full = min(seq.num_computed_tokens // BLOCK_SIZE, len(seq.block_table))
        for i in range(full):
            block = seq.block_table[i]
            tokens = tuple(seq.token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
            if self.manager._pool.ref_count(block) > 1 and block in self.content:
                assert self.content[block] == tokens, f"shared block {block} was rewritten"
            self.content[block] = tokens

    @rule(target=sequences, tokens=TOKENS)
    def admit(self, tokens: list[int]) -> str:
        seq = self._new(tokens)
        cached = self.manager.find_cached_prefix(seq)
        for i, block in enumerate(cached):
            expected = tuple(tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
            assert self.content.get(block) == expected, f"prefix hit on block {block} is stale"
        new = seq.num_tokens - len(cached) * BLOCK_SIZE
        assert new >= 1, "a prefix hit must leave a token to compute"
        if not self.manager.can_allocate(seq, new, cached):
            return ""
        self.manager.allocate(seq, new, cached)
        self.live[seq.request_id] = seq
        return seq.request_id

    @rule(name=sequences, data=st.data())
    def compute(self, name: str, data: st.DataObject) -> None:
        seq = self.live.get(name)
        if seq is None:
            return
        room = min(len(seq.block_table) * BLOCK_SIZE, seq.num_tokens) - seq.num_computed_tokens
        if room <= 0:
            return
        seq.num_computed_tokens += data.draw(st.integers(1, room))
        self.manager.cache_computed_blocks(seq)
        self._record_content(seq)

    @rule(name=sequences, tokens=TOKENS)
    def grow_or_preempt(self, name: str, tokens: list[int]) -> None:
        """New tokens (a decode, or a chunk): room for them, or the sequence is preempted."""
        seq = self.live.get(name)
        if seq is None or seq.num_computed_tokens < seq.num_tokens:
            return
        seq.token_ids += tokens
        wanted = seq.num_tokens - seq.num_computed_tokens
        if self.manager.can_append(seq, wanted):
            self.manager.append_slots(seq, wanted)
        else:
            self.manager.free(seq)
            seq.num_computed_tokens = 0
            del self.live[name]

    @rule(name=consumes(sequences))
    def finish(self, name: str) -> None:
        seq = self.live.pop(name, None)
        if seq is not None:
            self.manager.free(seq)
            assert seq.block_table == [] and seq.block_hashes == []

    @rule(target=reservations, count=st.integers(0, 5))
    def reserve(self, count: int) -> int:
        free = self.manager.num_free_blocks
        blocks = self.manager.reserve(count)
        if count > free:
            assert blocks is None and self.manager.num_free_blocks == free
            return -1
        assert blocks is not None and len(blocks) == count
        self.count += 1
        self.reserved[self.count] = blocks
        return self.count

    @precondition(lambda self: bool(self.reserved))
    @rule(key=consumes(reservations))
    def release(self, key: int) -> None:
        blocks = self.reserved.pop(key, None)
        if blocks is not None:
            self.manager.release(blocks)

    @invariant()
    def consistent(self) -> None:
        holders = [s.block_table for s in self.live.values()] + list(self.reserved.values())
        check_pool(self.manager, holders)
        for seq in self.live.values():
            check_hash_chain(
                self.manager, seq.token_ids, seq.block_table, seq.block_hashes,
                seq.num_computed_tokens,
            )  # fmt: skip

    def teardown(self) -> None:
        for seq in self.live.values():
            self.manager.free(seq)
        for blocks in self.reserved.values():
            self.manager.release(blocks)
        check_pool(self.manager, [])
        assert self.manager.num_free_blocks == NUM_BLOCKS, "blocks were lost"


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestBlockManager = BlockManagerMachine.TestCase
