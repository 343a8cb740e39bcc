"""The state snapshots of a hybrid model's prefix cache: a lookup finds the longest snapshot
whose KV is cached and whose tokens begin the sequence, never one still being written; rows are
bounded, pinned ones never taken, those whose KV is gone taken first; every tail block
reference taken is given back exactly once."""

from __future__ import annotations

from collections import Counter

from tandem.core.kv.prefix_cache import chain_hashes
from tandem.core.kv.state_snapshots import StateSnapshotCache

BS = 4
TOKENS = list(range(100, 140))
HASHES = chain_hashes(TOKENS, BS, None, 0, len(TOKENS) // BS)


class Blocks:
    """The block manager's side: references held on tail blocks, and which hashes are cached."""

    def __init__(self) -> None:
        self.refs: Counter[int] = Counter()
        self.cached = set(HASHES)

    def hold(self, block: int) -> int:
        self.refs[block] += 1
        return block

    def release(self, block: int) -> None:
        assert self.refs[block] > 0, f"block {block} released more often than held"
        self.refs[block] -= 1


def _cache(blocks: Blocks, rows: int = 4) -> StateSnapshotCache:
    return StateSnapshotCache(
        range(10, 10 + rows),
        BS,
        release_block=blocks.release,
        is_cached=blocks.cached.__contains__,
        ref_count=lambda b: blocks.refs[b],
    )


def _snapshot(cache: StateSnapshotCache, blocks: Blocks, end: int, block: int = 90) -> int:
    """A completed snapshot of TOKENS[:end]; its row."""
    full = end // BS
    tail = tuple(TOKENS[full * BS : end])
    snap = cache.reserve(
        end, HASHES[full - 1] if full else None, tail, blocks.hold(block) if tail else None
    )
    assert snap is not None
    cache.complete(snap, written=True)
    return snap.row


def test_the_longest_snapshot_whose_blocks_are_cached_and_within_the_limit() -> None:
    blocks = Blocks()
    cache = _cache(blocks)
    rows = {end: _snapshot(cache, blocks, end, block=end) for end in (6, 13, 24)}
    found = cache.lookup(TOKENS, HASHES, limit=39)
    assert found is not None and (found.num_tokens, found.row) == (24, rows[24])
    # Only 3 blocks cached for this sequence: 13 (3 full blocks and a tail) is the longest.
    found = cache.lookup(TOKENS, HASHES[:3], limit=39)
    assert found is not None and found.num_tokens == 13 and found.tail == (112,)
    # The last token must be computed: a limit below 13 leaves 6.
    found = cache.lookup(TOKENS, HASHES, limit=12)
    assert found is not None and found.num_tokens == 6
    # Tokens that part ways inside the tail: not that snapshot.
    other = [*TOKENS[:12], 1, *TOKENS[13:]]
    found = cache.lookup(other, chain_hashes(other, BS, None, 0, 3), limit=39)
    assert found is not None and found.num_tokens == 6


def test_a_snapshot_being_written_is_found_by_no_lookup_and_a_failed_one_goes() -> None:
    blocks = Blocks()
    cache = _cache(blocks)
    snap = cache.reserve(10, HASHES[1], (108, 109), blocks.hold(7))
    assert snap is not None and cache.lookup(TOKENS, HASHES, limit=39) is None
    cache.complete(snap, written=False)
    assert cache.num_snapshots == 0 and cache.num_free_rows == 4 and blocks.refs[7] == 0


def test_a_prefix_snapshotted_twice_keeps_the_first_and_gives_the_block_back() -> None:
    blocks = Blocks()
    cache = _cache(blocks)
    _snapshot(cache, blocks, 10, block=7)
    assert cache.reserve(10, HASHES[1], (108, 109), blocks.hold(8)) is None
    assert blocks.refs[8] == 0 and blocks.refs[7] == 1 and cache.num_snapshots == 1


def test_rows_go_least_recently_used_first_never_pinned_and_stale_before_all() -> None:
    blocks = Blocks()
    cache = _cache(blocks, rows=3)
    for end in (4, 8, 12):
        _snapshot(cache, blocks, end)
    # A lookup pins and refreshes 12; 4 is the oldest unpinned.
    pinned = cache.lookup(TOKENS, HASHES, limit=39)
    assert pinned is not None and pinned.num_tokens == 12
    _snapshot(cache, blocks, 16)
    assert sorted(s.num_tokens for s in cache._by_key.values()) == [8, 12, 16]
    # 16's first block left the prefix cache: it goes before the older 8.
    blocks.cached.discard(HASHES[3])
    _snapshot(cache, blocks, 20)
    assert sorted(s.num_tokens for s in cache._by_key.values()) == [8, 12, 20]
    # Every row pinned: nothing to take.
    for snap in list(cache._by_key.values()):
        snap.pins += 1
    assert cache.reserve(24, HASHES[5], (), None) is None
    cache.unpin(pinned)


def test_adopting_a_slot_hands_back_another_row_and_is_found_at_once() -> None:
    blocks = Blocks()
    cache = _cache(blocks, rows=2)
    given = cache.adopt(3, 22, HASHES[4], (120, 121), blocks.hold(5))
    assert given == 10
    found = cache.lookup(TOKENS, HASHES, limit=39)
    assert found is not None and found.row == 3 and found.num_tokens == 22
    cache.unpin(found)
    # That prefix is kept already: nothing changes, the caller keeps its row and block.
    assert cache.adopt(4, 22, HASHES[4], (120, 121), 6) is None
    assert cache.num_free_rows == 1


def test_blocks_only_snapshots_hold_are_counted_and_given_back_on_demand() -> None:
    blocks = Blocks()
    cache = _cache(blocks)
    _snapshot(cache, blocks, 6, block=7)
    _snapshot(cache, blocks, 7, block=7)
    _snapshot(cache, blocks, 9, block=8)
    assert cache.num_tail_blocks == 2 and cache.freeable_blocks() == 2
    # A running sequence still writes block 8: not only the snapshots', dropping 9 frees
    # nothing; and 3 blocks cannot be freed, so nothing is dropped.
    blocks.hold(8)
    assert cache.num_tail_blocks == 1 and cache.freeable_blocks() == 1
    assert cache.free_blocks(2) == 0 and cache.num_snapshots == 3
    # Block 7 goes with both snapshots that hold it.
    assert cache.free_blocks(1) == 1
    assert blocks.refs[7] == 0 and cache.num_snapshots == 1
    # A pinned holder keeps its block.
    blocks.release(8)
    pinned = cache.lookup(TOKENS, HASHES, limit=39)
    assert pinned is not None and pinned.num_tokens == 9
    assert cache.freeable_blocks() == 0 and cache.free_blocks(1) == 0
    cache.unpin(pinned)
    cache.clear()
    assert cache.num_snapshots == 0 and cache.num_free_rows == 4
    assert sum(blocks.refs.values()) == 0
