"""Invariants of a block manager's pool and prefix cache, given who holds which blocks;
shared by the property tests of the block manager and the schedulers."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from tandem.core.kv.block_manager import BlockManager
from tandem.core.kv.block_pool import NULL_BLOCK
from tandem.core.kv.prefix_cache import chain_hashes


def check_pool(manager: BlockManager, holders: Iterable[list[int]]) -> None:
    """Every block's reference count is the number of times ``holders`` (block tables and
    reservations) list it; the free list is exactly the unreferenced blocks, each once; the
    null block is never handed out; the prefix cache's two maps are inverses."""
    pool = manager._pool
    held = Counter(b for blocks in holders for b in blocks)
    assert NULL_BLOCK not in held, "the null block was handed out"
    for block in range(1, pool.num_blocks + 1):
        count = pool.ref_count(block)
        assert count >= 0, f"block {block} released more often than taken"
        assert count == held[block], f"block {block}: ref count {count}, held {held[block]}"
        assert (block in pool._free) == (count == 0), f"block {block} free list vs count {count}"
    assert len(pool._free) == manager.num_free_blocks
    assert NULL_BLOCK not in pool._free
    cache = manager._cache
    if cache is not None:
        for h, block in cache._hash_to_block.items():
            assert cache._block_to_hash.get(block) == h, f"hash maps disagree on block {block}"
        for block, h in cache._block_to_hash.items():
            assert cache._hash_to_block.get(h) == block, f"hash maps disagree on block {block}"


def check_hash_chain(
    manager: BlockManager,
    token_ids: list[int],
    block_table: list[int],
    block_hashes: list[int],
    num_computed: int,
) -> None:
    """A sequence's hashes are the chain over its full computed blocks, no further."""
    size = manager.block_size
    assert len(block_hashes) <= min(num_computed // size, len(block_table))
    assert block_hashes == chain_hashes(token_ids, size, None, 0, len(block_hashes))
