"""Splitting one rank's cache memory between state slots and KV blocks: slots for the most
sequences that run at once, within half of the free memory; blocks from the rest; explicit
counts win; a budget without room for one slot fails at start-up, naming the flags."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from tandem.core.config import CacheConfig
from tandem.core.errors import ConfigError
from tandem.core.kv.cache_sizing import CacheCosts, CacheSize, size_cache
from tandem.core.kv.kv_cache import GIB, sequence_block_demand
from tandem.device import Device, MemoryInfo

MEMORY = MemoryInfo(total_bytes=64 * GIB, free_bytes=60 * GIB)
CPU = Device("cpu")


def _size(config: CacheConfig, costs: CacheCosts, max_seqs: int = 64) -> CacheSize:
    return size_cache(config, max_seqs, CPU, MEMORY, costs)


def test_models_without_state_get_blocks_only() -> None:
    costs = CacheCosts(weight_bytes=0, block_bytes=1 << 20, state_slot_bytes=0)
    assert _size(CacheConfig(cpu_memory_gb=1.0, max_memory_utilization=1.0), costs) == CacheSize(
        1024, 0
    )


def test_slots_for_every_sequence_of_a_batch_then_blocks_from_the_rest() -> None:
    config = CacheConfig(cpu_memory_gb=1.0, max_memory_utilization=1.0)
    costs = CacheCosts(weight_bytes=GIB // 4, block_bytes=1 << 20, state_slot_bytes=1 << 20)
    size = _size(config, costs, max_seqs=16)
    assert size.num_state_slots == 16
    # Two prefix-cache snapshots per slot, by default.
    assert size.num_state_snapshots == 32
    assert size.num_blocks == (GIB - GIB // 4 - 48 * (1 << 20)) // (1 << 20)


def test_snapshots_take_what_state_cache_mb_says_and_none_without_prefix_caching() -> None:
    costs = CacheCosts(weight_bytes=0, block_bytes=1 << 20, state_slot_bytes=3 << 20)
    base = CacheConfig(cpu_memory_gb=1.0, max_memory_utilization=1.0)
    sized = _size(replace(base, state_cache_mb=100), costs, max_seqs=16)
    assert (sized.num_state_slots, sized.num_state_snapshots) == (16, 33)
    assert sized.num_blocks == 1024 - 3 * (16 + 33)
    assert _size(replace(base, state_cache_mb=0), costs).num_state_snapshots == 0
    assert _size(replace(base, enable_prefix_cache=False), costs).num_state_snapshots == 0
    with pytest.raises(ConfigError, match="--state-cache-mb must be >= 0"):
        replace(base, state_cache_mb=-1)


def test_default_snapshots_get_only_what_the_slots_leave_of_the_state_share() -> None:
    # 100 MiB rows, 1 GiB: the state's half holds 5 rows; 3 slots leave 2 for snapshots.
    costs = CacheCosts(weight_bytes=0, block_bytes=1 << 20, state_slot_bytes=100 << 20)
    config = CacheConfig(cpu_memory_gb=1.0, max_memory_utilization=1.0)
    size = _size(config, costs, max_seqs=3)
    assert (size.num_state_slots, size.num_state_snapshots) == (3, 2)


def test_speculative_scratch_rows_come_with_each_slot_and_are_budgeted() -> None:
    """Speculative decoding on a hybrid: ``num_speculative_tokens`` scratch rows per slot,
    counted with the slot against the state's share, then the snapshots, then the blocks."""
    config = CacheConfig(cpu_memory_gb=1.0, max_memory_utilization=1.0)
    costs = CacheCosts(weight_bytes=0, block_bytes=1 << 20, state_slot_bytes=1 << 20)
    size = size_cache(config, 16, CPU, MEMORY, costs, scratch_per_slot=3)
    assert (size.num_state_slots, size.num_state_scratch, size.num_state_snapshots) == (16, 48, 32)
    assert size.num_state_rows == 16 + 48 + 32
    assert size.num_blocks == 1024 - 96
    # 100 MiB rows: the state's half (5 rows) holds one slot with its 3 scratch rows, and the
    # one row left is a snapshot.
    costs = replace(costs, state_slot_bytes=100 << 20)
    size = size_cache(config, 16, CPU, MEMORY, costs, scratch_per_slot=3)
    assert (size.num_state_slots, size.num_state_scratch, size.num_state_snapshots) == (1, 3, 1)
    with pytest.raises(ConfigError, match="with 9 scratch rows for speculative drafts"):
        size_cache(config, 16, CPU, MEMORY, costs, scratch_per_slot=9)


def test_slots_take_at_most_half_of_the_free_memory() -> None:
    config = CacheConfig(cpu_memory_gb=1.0, max_memory_utilization=1.0)
    # 100 MiB per slot, 1 GiB free: 5 slots fit in half, not the 64 a batch could run.
    costs = CacheCosts(weight_bytes=0, block_bytes=1 << 20, state_slot_bytes=100 << 20)
    size = _size(config, costs)
    assert size.num_state_slots == 5
    assert size.num_blocks == (GIB - 500 * (1 << 20)) // (1 << 20)


def test_explicit_counts_win() -> None:
    costs = CacheCosts(weight_bytes=0, block_bytes=1 << 20, state_slot_bytes=1 << 20)
    assert _size(CacheConfig(num_blocks=7, num_state_slots=3), costs) == CacheSize(7, 3, 16)
    config = CacheConfig(num_state_slots=2, cpu_memory_gb=1.0, max_memory_utilization=1.0)
    assert _size(config, costs).num_blocks == GIB // (1 << 20) - 2 - 16


def test_no_room_for_one_slot_fails_naming_the_flags() -> None:
    costs = CacheCosts(weight_bytes=GIB // 2, block_bytes=1024, state_slot_bytes=GIB)
    with pytest.raises(ConfigError, match="state slot") as failure:
        _size(CacheConfig(cpu_memory_gb=1.0), costs)
    assert "--cpu-memory-gb" in str(failure.value) and "--num-state-slots" in str(failure.value)
    with pytest.raises(ConfigError, match="--num-state-slots must be >= 1"):
        CacheConfig(num_state_slots=0)


def test_a_model_without_full_attention_needs_an_explicit_block_count() -> None:
    costs = CacheCosts(weight_bytes=0, block_bytes=0, state_slot_bytes=1 << 20)
    with pytest.raises(ConfigError, match="--num-blocks"):
        _size(CacheConfig(), costs)
    assert _size(CacheConfig(num_blocks=9), costs) == CacheSize(9, 64, 128)


def test_blocks_stop_at_what_the_running_sequences_can_hold() -> None:
    # 1 GiB of 1 MiB blocks fits 1024; 4 sequences of 100 tokens in blocks of 16 hold 28.
    costs = CacheCosts(weight_bytes=0, block_bytes=1 << 20, state_slot_bytes=0)
    config = CacheConfig(cpu_memory_gb=1.0, max_memory_utilization=1.0)
    demand = sequence_block_demand(4, 100, 16, prefix_cache=False)
    assert demand.blocks == 4 * 7
    assert size_cache(config, 4, CPU, MEMORY, costs, demand) == CacheSize(28, 0)
    cached = sequence_block_demand(4, 100, 16, prefix_cache=True)
    assert size_cache(config, 4, CPU, MEMORY, costs, cached) == CacheSize(56, 0)
    # Less memory than the demand: memory decides, as before.
    tight = CacheConfig(cpu_memory_gb=16 / 1024, max_memory_utilization=1.0)
    assert size_cache(tight, 4, CPU, MEMORY, costs, demand) == CacheSize(16, 0)


def test_a_hybrid_without_a_snapshot_row_gets_no_blocks_for_the_prefix_cache() -> None:
    """Without a snapshot row a hybrid serves without prefix caching (the engine turns it
    off), so its blocks are not doubled for it; ``--state-cache-mb`` too small for one row
    is refused, naming what one takes."""
    config = CacheConfig(cpu_memory_gb=1.0, max_memory_utilization=1.0)
    costs = CacheCosts(weight_bytes=0, block_bytes=1 << 20, state_slot_bytes=3 << 20)
    cached = sequence_block_demand(4, 100, 16, prefix_cache=True)
    with_rows = size_cache(config, 4, CPU, MEMORY, costs, cached)
    assert (with_rows.num_state_snapshots, with_rows.num_blocks) == (16, 56)
    none = size_cache(replace(config, state_cache_mb=0), 4, CPU, MEMORY, costs, cached)
    assert (none.num_state_snapshots, none.num_blocks) == (0, 28)
    # The default, when the state's share holds the slots and nothing more.
    tight = replace(costs, state_slot_bytes=128 << 20)
    assert size_cache(config, 4, CPU, MEMORY, tight, cached) == CacheSize(28, 4, 0)
    with pytest.raises(
        ConfigError, match=r"--state-cache-mb 2 holds no state snapshot.*at least 3"
    ):
        size_cache(replace(config, state_cache_mb=2), 4, CPU, MEMORY, costs, cached)


def test_an_explicit_block_count_wins_over_the_demand(caplog: pytest.LogCaptureFixture) -> None:
    costs = CacheCosts(weight_bytes=0, block_bytes=1 << 20, state_slot_bytes=1 << 20)
    demand = sequence_block_demand(2, 32, 16, prefix_cache=False)
    with caplog.at_level(logging.INFO, logger="tandem.core.kv.kv_cache"):
        assert _size(CacheConfig(num_blocks=500), costs).num_blocks == 500
        config = CacheConfig(num_blocks=500)
        assert size_cache(config, 2, CPU, MEMORY, costs, demand) == CacheSize(500, 2, 16)
    assert "as --num-blocks says" in caplog.text


def test_the_log_says_the_budget_and_why(caplog: pytest.LogCaptureFixture) -> None:
    costs = CacheCosts(weight_bytes=0, block_bytes=1 << 20, state_slot_bytes=0)
    config = CacheConfig(cpu_memory_gb=1.0, max_memory_utilization=1.0)
    demand = sequence_block_demand(4, 100, 16, prefix_cache=True)
    with caplog.at_level(logging.INFO, logger="tandem.core.kv.kv_cache"):
        size_cache(config, 4, CPU, MEMORY, costs, demand)
    line = caplog.records[-1].getMessage()
    assert "56 blocks" in line and "4 sequences (--max-num-seqs)" in line, line
    assert "100 tokens (--max-model-len)" in line and "prefix cache" in line, line
    assert "would allow 1024" in line, line
