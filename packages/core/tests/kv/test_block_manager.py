"""Block accounting: reference counts, the null block, prefix-cache hits and eviction."""

from __future__ import annotations

from tandem.core.kv.block_manager import BlockManager
from tandem.core.kv.block_pool import NULL_BLOCK
from tandem.core.llm.sampling_params import SamplingParams
from tandem.core.llm.sequence import TokenSequence


def _seq(rid: str, tokens: list[int]) -> TokenSequence:
    return TokenSequence(
        request_id=rid,
        prompt_token_ids=tokens,
        params=SamplingParams(),
        eos_token_ids=frozenset(),
        max_total_tokens=10_000,
    )


def _run_prefill(manager: BlockManager, seq: TokenSequence) -> None:
    cached = manager.find_cached_prefix(seq)
    new = seq.num_tokens - len(cached) * manager.block_size
    assert manager.can_allocate(seq, new, cached)
    manager.allocate(seq, new, cached)
    seq.num_computed_tokens += new
    manager.cache_computed_blocks(seq)


def test_allocate_append_free_keeps_counts() -> None:
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_cache=False)
    seq = _seq("a", list(range(10)))
    _run_prefill(manager, seq)
    assert len(seq.block_table) == 3 and NULL_BLOCK not in seq.block_table
    assert manager.num_free_blocks == 5
    seq.token_ids += [1, 2, 3]
    assert manager.can_append(seq, 3)
    manager.append_slots(seq, 3)
    assert len(seq.block_table) == 4
    assert not manager.can_append(seq, 100)
    manager.free(seq)
    assert manager.num_free_blocks == 8 and seq.block_table == []


def test_prefix_hits_share_blocks_and_leave_a_token_to_compute() -> None:
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_cache=True)
    a = _seq("a", list(range(12)))
    _run_prefill(manager, a)
    b = _seq("b", list(range(12)))
    cached = manager.find_cached_prefix(b)
    # 12 tokens = 3 full blocks, but the last token must be recomputed: 2 hits.
    assert cached == a.block_table[:2]
    _run_prefill(manager, b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    # Diverging after the first block: one hit.
    c = _seq("c", [*range(4), 99, 98, 97, 96, 95])
    assert manager.find_cached_prefix(c) == a.block_table[:1]
    shared = a.block_table[:2]
    manager.free(a)
    manager.free(b)
    assert manager.num_free_blocks == 16
    # Freed blocks stay findable until reused.
    assert manager.find_cached_prefix(_seq("d", list(range(12)))) == shared


def test_cached_free_blocks_count_as_free_and_get_evicted() -> None:
    manager = BlockManager(num_blocks=4, block_size=2, enable_prefix_cache=True)
    a = _seq("a", [1, 2, 3, 4, 5])
    _run_prefill(manager, a)
    manager.free(a)
    assert manager.num_free_blocks == 4
    big = _seq("big", list(range(100, 108)))
    _run_prefill(manager, big)  # needs all 4 blocks: evicts a's cached ones
    assert manager.find_cached_prefix(_seq("again", [1, 2, 3, 4, 5])) == []
    manager.free(big)
    assert manager.num_free_blocks == 4


def test_hit_on_a_free_cached_block_is_not_counted_twice() -> None:
    manager = BlockManager(num_blocks=3, block_size=2, enable_prefix_cache=True)
    a = _seq("a", [1, 2, 3, 4, 5])
    _run_prefill(manager, a)
    manager.free(a)
    b = _seq("b", [1, 2, 3, 4, 5, 6, 7])
    cached = manager.find_cached_prefix(b)
    assert len(cached) == 2
    # 2 cached + 2 new blocks > 3 blocks in all.
    assert not manager.can_allocate(b, 3, cached)
    assert manager.can_allocate(_seq("c", [1, 2, 3, 4, 5]), 1, cached)


def test_concurrent_reserve_and_release_keep_the_pool_whole() -> None:
    """The scheduler reserves while step completions release, from other threads."""
    import threading

    manager = BlockManager(num_blocks=64, block_size=16, enable_prefix_cache=False)
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def churn(seed: int) -> None:
        try:
            barrier.wait(timeout=10)
            held: list[list[int]] = []
            for i in range(2000):
                got = manager.reserve(1 + (seed + i) % 5)
                if got is not None:
                    held.append(got)
                if held and (i % 3 == 0 or got is None):
                    manager.release(held.pop(0))
            for blocks in held:
                manager.release(blocks)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert manager.num_free_blocks == 64
    # Every block comes back exactly once: a full reservation takes them all, distinct.
    everything = manager.reserve(64)
    assert everything is not None and sorted(everything) == list(range(1, 65))
