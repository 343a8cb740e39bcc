"""Per-sequence KV block accounting on top of the block pool and the prefix cache: which
blocks a sequence holds, what it can get next, and publishing its full blocks for reuse.

Thread-safe: with several steps in flight, the scheduler allocates while step completions
free, from different threads. Every public method holds one lock (from the sync facade).
"""

from __future__ import annotations

from typing import Protocol

from tandem.core.kv.block_pool import BlockPool
from tandem.core.kv.prefix_cache import PrefixCache, chain_hashes
from tandem.device.sync import REAL_SYNC, Sync


class BlockOwner(Protocol):
    """What the manager needs of a sequence (the products above define theirs)."""

    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    # Prefix-cache hash of each full block of token_ids, filled as blocks become full.
    block_hashes: list[int]

    @property
    def num_tokens(self) -> int: ...


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_cache: bool,
        sync: Sync = REAL_SYNC,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self._cache = PrefixCache() if enable_prefix_cache else None
        self._pool = BlockPool(num_blocks, self._cache.forget if self._cache else None)
        self._lock = sync.lock()

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self._pool.num_free / self._pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: BlockOwner) -> list[int]:
        """Blocks already holding a prefix of ``seq``; at least one token is left to compute."""
        return self.cached_prefix(seq)[0]

    def cached_prefix(self, seq: BlockOwner) -> tuple[list[int], list[int]]:
        """``find_cached_prefix``'s blocks, and the chain hash of each."""
        if self._cache is None:
            return [], []
        # The last token must run through the model to give the logits to sample from.
        usable = (seq.num_tokens - 1) // self.block_size
        hashes = chain_hashes(seq.token_ids, self.block_size, None, 0, usable)
        with self._lock:
            blocks = self._cache.lookup(hashes)
        return blocks, hashes[: len(blocks)]

    def is_cached(self, h: int) -> bool:
        """Whether the block of chain hash ``h`` is still in the prefix cache."""
        with self._lock:
            return self._cache is not None and self._cache.holds(h)

    def prefix_hashes(self, seq: BlockOwner, num_full: int) -> list[int]:
        """Chain hashes of ``seq``'s first ``num_full`` blocks (those published, and the rest
        computed from its tokens)."""
        known = seq.block_hashes[:num_full]
        parent = known[-1] if known else None
        return known + chain_hashes(seq.token_ids, self.block_size, parent, len(known), num_full)

    def hold(self, block: int) -> None:
        """One more reference to a block a sequence holds (a state snapshot keeps the KV of
        its last, partial block beyond the sequence's end); ``release_block`` drops it."""
        with self._lock:
            self._pool.share(block)

    def ref_count(self, block: int) -> int:
        with self._lock:
            return self._pool.ref_count(block)

    def release_block(self, block: int) -> None:
        with self._lock:
            self._pool.release(block)

    def can_allocate(
        self,
        seq: BlockOwner,
        num_new_tokens: int,
        cached: list[int],
        num_cached_tokens: int | None = None,
    ) -> bool:
        """Whether a waiting ``seq`` can start with ``cached`` blocks and ``num_new_tokens``
        (``num_cached_tokens``: tokens it starts with, when more than ``cached`` holds: the
        rest go into its first new block, copied from a state snapshot's). Cache hits on freed
        blocks take those blocks off the free list."""
        return self.allocate_deficit(seq, num_new_tokens, cached, num_cached_tokens) <= 0

    def allocate(
        self,
        seq: BlockOwner,
        num_new_tokens: int,
        cached: list[int],
        num_cached_tokens: int | None = None,
    ) -> None:
        """Give a waiting ``seq`` its prefix-cache hits plus blocks for ``num_new_tokens``
        (``num_cached_tokens`` as for ``can_allocate``)."""
        assert not seq.block_table, "allocate() is for sequences without blocks"
        with self._lock:
            for block in cached:
                self._pool.share(block)
            seq.block_table = list(cached)
            seq.num_computed_tokens = (
                len(cached) * self.block_size if num_cached_tokens is None else num_cached_tokens
            )
            cache = self._cache
            seq.block_hashes = [cache.hash_of(b) for b in cached] if cache is not None else []
            self._append(seq, num_new_tokens)

    def allocate_deficit(
        self,
        seq: BlockOwner,
        num_new_tokens: int,
        cached: list[int],
        num_cached_tokens: int | None = None,
    ) -> int:
        """Blocks that ``can_allocate`` lacks (0 or less: none)."""
        start = len(cached) * self.block_size if num_cached_tokens is None else num_cached_tokens
        needed = self.blocks_for(start + num_new_tokens) - len(cached)
        with self._lock:
            reclaimed = sum(1 for b in cached if self._pool.ref_count(b) == 0)
            return needed - (self._pool.num_free - reclaimed)

    def append_deficit(self, seq: BlockOwner, num_new_tokens: int) -> int:
        """Blocks that ``can_append`` lacks (0 or less: none)."""
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        with self._lock:
            return needed - self._pool.num_free

    def can_append(self, seq: BlockOwner, num_new_tokens: int) -> bool:
        return self.append_deficit(seq, num_new_tokens) <= 0

    def append_slots(self, seq: BlockOwner, num_new_tokens: int) -> None:
        with self._lock:
            self._append(seq, num_new_tokens)

    def _append(self, seq: BlockOwner, num_new_tokens: int) -> None:
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed > self._pool.num_free:
            raise RuntimeError("append_slots() without room; call can_append() first")
        for _ in range(needed):
            seq.block_table.append(self._pool.take())

    def trim(self, seq: BlockOwner, num_tokens: int) -> None:
        """Give back ``seq``'s blocks past those that ``num_tokens`` tokens need (blocks
        taken for speculative positions that were rejected)."""
        with self._lock:
            keep = self.blocks_for(num_tokens)
            for block in reversed(seq.block_table[keep:]):
                self._pool.release(block)
            del seq.block_table[keep:]

    def reserve(self, num_blocks: int) -> list[int] | None:
        """``num_blocks`` blocks at once, or None (and nothing taken) if there are fewer free:
        for requests whose whole footprint is known up front."""
        with self._lock:
            if num_blocks > self._pool.num_free:
                return None
            return [self._pool.take() for _ in range(num_blocks)]

    def release(self, blocks: list[int]) -> None:
        """Give back blocks from ``reserve``."""
        with self._lock:
            for block in reversed(blocks):
                self._pool.release(block)

    def cache_computed_blocks(self, seq: BlockOwner) -> None:
        """Publish the hashes of blocks that became full of computed tokens."""
        if self._cache is None:
            return
        with self._lock:
            num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
            start = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            hashes = chain_hashes(seq.token_ids, self.block_size, parent, start, num_full)
            for i, h in enumerate(hashes, start):
                seq.block_hashes.append(h)
                self._cache.publish(h, seq.block_table[i])

    def free(self, seq: BlockOwner) -> None:
        # Reverse order: a sequence's tail blocks are the least likely to be shared, so
        # they are reused first and the shared prefix stays cached longest.
        with self._lock:
            for block in reversed(seq.block_table):
                self._pool.release(block)
            seq.block_table = []
            seq.block_hashes = []
