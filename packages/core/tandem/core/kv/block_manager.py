"""Paged KV-cache block accounting with reference counts and prefix caching of full blocks.

Block 0 is the null block: it is never handed out, and padded block tables point at it, so
attention never reads uninitialised memory. A full block is identified by a hash chain over
its tokens and every token before it; freed blocks that carry a hash stay findable until
they are reused (least recently freed first).

Thread-safe: with several steps in flight, the scheduler allocates while step completions
free, from different threads. Every public method holds one lock (from the sync facade).
"""

from __future__ import annotations

from collections import OrderedDict

from tandem.core.llm.sequence import TokenSequence
from tandem.device.sync import REAL_SYNC, Sync

NULL_BLOCK = 0


def block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_cache: bool,
        sync: Sync = REAL_SYNC,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        # Physical ids 1..num_blocks; id 0 is the null block.
        self._ref_counts = [0] * (num_blocks + 1)
        self._free: OrderedDict[int, None] = OrderedDict(
            (b, None) for b in range(1, num_blocks + 1)
        )
        self._hash_to_block: dict[int, int] = {}
        self._block_to_hash: dict[int, int] = {}
        self._lock = sync.lock()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _hashes_of_full_prompt_blocks(self, seq: TokenSequence) -> list[int]:
        hashes: list[int] = []
        parent: int | None = None
        bs = self.block_size
        for i in range(seq.num_tokens // bs):
            parent = block_hash(parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]))
            hashes.append(parent)
        return hashes

    def find_cached_prefix(self, seq: TokenSequence) -> list[int]:
        """Blocks already holding a prefix of ``seq``; at least one token is left to compute."""
        if not self.enable_prefix_cache:
            return []
        # The last token must run through the model to give the logits to sample from.
        usable = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        with self._lock:
            for h in self._hashes_of_full_prompt_blocks(seq)[:usable]:
                block = self._hash_to_block.get(h)
                if block is None:
                    break
                hits.append(block)
        return hits

    def can_allocate(self, seq: TokenSequence, num_new_tokens: int, cached: list[int]) -> bool:
        """Whether a waiting ``seq`` can start with ``cached`` blocks and ``num_new_tokens``."""
        needed = self.blocks_for(len(cached) * self.block_size + num_new_tokens) - len(cached)
        with self._lock:
            reclaimed = sum(1 for b in cached if self._ref_counts[b] == 0)
            return needed <= len(self._free) - reclaimed

    def allocate(self, seq: TokenSequence, num_new_tokens: int, cached: list[int]) -> None:
        """Give a waiting ``seq`` its prefix-cache hits plus blocks for ``num_new_tokens``."""
        assert not seq.block_table, "allocate() is for sequences without blocks"
        with self._lock:
            for block in cached:
                if self._ref_counts[block] == 0:
                    del self._free[block]
                self._ref_counts[block] += 1
            seq.block_table = list(cached)
            seq.num_computed_tokens = len(cached) * self.block_size
            seq.block_hashes = [self._block_to_hash[b] for b in cached]
            self._append(seq, num_new_tokens)

    def can_append(self, seq: TokenSequence, num_new_tokens: int) -> bool:
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        with self._lock:
            return needed <= len(self._free)

    def append_slots(self, seq: TokenSequence, num_new_tokens: int) -> None:
        with self._lock:
            self._append(seq, num_new_tokens)

    def _append(self, seq: TokenSequence, num_new_tokens: int) -> None:
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed > len(self._free):
            raise RuntimeError("append_slots() without room; call can_append() first")
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())

    def reserve(self, num_blocks: int) -> list[int] | None:
        """``num_blocks`` blocks at once, or None (and nothing taken) if there are fewer free:
        for requests whose whole footprint is known up front."""
        with self._lock:
            if num_blocks > len(self._free):
                return None
            return [self._take_free_block() for _ in range(num_blocks)]

    def release(self, blocks: list[int]) -> None:
        """Give back blocks from ``reserve``."""
        with self._lock:
            for block in reversed(blocks):
                self._ref_counts[block] -= 1
                if self._ref_counts[block] == 0:
                    self._free[block] = None

    def _take_free_block(self) -> int:
        block, _ = self._free.popitem(last=False)
        old = self._block_to_hash.pop(block, None)
        if old is not None and self._hash_to_block.get(old) == block:
            del self._hash_to_block[old]
        self._ref_counts[block] = 1
        return block

    def cache_computed_blocks(self, seq: TokenSequence) -> None:
        """Publish the hashes of blocks that became full of computed tokens."""
        if not self.enable_prefix_cache:
            return
        bs = self.block_size
        with self._lock:
            num_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            for i in range(len(seq.block_hashes), num_full):
                parent = block_hash(parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]))
                seq.block_hashes.append(parent)
                block = seq.block_table[i]
                if parent not in self._hash_to_block and block not in self._block_to_hash:
                    self._hash_to_block[parent] = block
                    self._block_to_hash[block] = parent

    def free(self, seq: TokenSequence) -> None:
        # Reverse order: a sequence's tail blocks are the least likely to be shared, so
        # they are reused first and the shared prefix stays cached longest.
        with self._lock:
            for block in reversed(seq.block_table):
                self._ref_counts[block] -= 1
                if self._ref_counts[block] == 0:
                    self._free[block] = None
            seq.block_table = []
            seq.block_hashes = []

    def reset_prefix_cache(self) -> None:
        with self._lock:
            self._hash_to_block.clear()
            self._block_to_hash.clear()
