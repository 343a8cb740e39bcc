"""KV-cache sizing from memory and allocation with a zeroed null block."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tandem.core.config import CacheConfig
from tandem.core.errors import ConfigError
from tandem.core.kv import kv_cache
from tandem.core.kv.kv_cache import GIB, allocate_kv_cache, bytes_per_block, num_blocks_for_memory
from tandem.device import Device, MemoryInfo


def test_bytes_per_block() -> None:
    # keys + values, 2 layers, 16 slots, 4 heads of 8, float32
    assert bytes_per_block(2, 4, 8, 16, torch.float32) == 2 * 2 * 16 * 4 * 8 * 4


def test_cpu_sizing_uses_the_budget_minus_weights() -> None:
    config = CacheConfig(cpu_memory_gb=1.0, max_memory_utilization=0.5)
    memory = MemoryInfo(total_bytes=64 * GIB, free_bytes=60 * GIB)
    blocks = num_blocks_for_memory(
        config, Device("cpu"), memory, weight_bytes=GIB // 4, block_bytes=1 << 20
    )
    assert blocks == (GIB // 2 - GIB // 4) // (1 << 20)


def test_device_sizing_uses_total_memory_and_what_is_in_use() -> None:
    config = CacheConfig(max_memory_utilization=0.9)
    memory = MemoryInfo(total_bytes=10 * GIB, free_bytes=8 * GIB)
    blocks = num_blocks_for_memory(
        config, Device("npu"), memory, weight_bytes=0, block_bytes=GIB // 10
    )
    assert blocks == int(9 * GIB - 2 * GIB) // (GIB // 10)


def test_explicit_block_count_wins_and_no_room_is_an_error() -> None:
    memory = MemoryInfo(total_bytes=GIB, free_bytes=GIB)
    assert num_blocks_for_memory(CacheConfig(num_blocks=7), Device("cpu"), memory, 0, 1) == 7
    with pytest.raises(ConfigError, match="--cpu-memory-gb"):
        num_blocks_for_memory(
            CacheConfig(cpu_memory_gb=0.001),
            Device("cpu"),
            memory,
            weight_bytes=GIB,
            block_bytes=1024,
        )


def test_cache_starts_zeroed() -> None:
    caches = allocate_kv_cache(
        2,
        num_blocks=3,
        block_size=4,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
        prefault=True,
    )
    assert len(caches) == 2
    for k, v in caches:
        assert k.shape == (4, 4, 2, 8)
        assert torch.count_nonzero(k) == 0 and torch.count_nonzero(v) == 0


def _resident_kib() -> int:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") // 1024


def _host_cache(
    num_layers: int, num_blocks: int, prefault: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Blocks of 32 KiB (16 positions of 8 heads of 64 float32s), K and V per layer."""
    return allocate_kv_cache(
        num_layers,
        num_blocks=num_blocks,
        block_size=16,
        num_kv_heads=8,
        head_dim=64,
        dtype=torch.float32,
        device=torch.device("cpu"),
        prefault=prefault,
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_host_cache_holds_only_the_pages_attention_touched() -> None:
    # 512 MiB of blocks: zero-filled up front, every page would be resident at once.
    before = _resident_kib()
    caches = _host_cache(num_layers=4, num_blocks=4095, prefault=False)
    grown = _resident_kib() - before
    assert grown < 64 * 1024, f"{grown} KiB resident after allocating 512 MiB"
    k, v = caches[3]
    assert torch.count_nonzero(k[4095]) == 0 and torch.count_nonzero(v[17]) == 0
    k[5].fill_(1.0)
    assert float(caches[3][0][5].sum()) == 16 * 8 * 64
    assert torch.count_nonzero(caches[3][0]) == 16 * 8 * 64


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_prefaulted_host_cache_is_resident_before_serving_and_still_zero() -> None:
    before = _resident_kib()
    caches = _host_cache(num_layers=2, num_blocks=255, prefault=True)
    # 2 layers x (K, V) x 256 blocks x 32 KiB: 32 MiB, all of it backed at once.
    grown = _resident_kib() - before
    assert grown >= 31 * 1024, f"{grown} KiB resident after prefaulting 32 MiB"
    assert all(torch.count_nonzero(k) == 0 and torch.count_nonzero(v) == 0 for k, v in caches)


def test_a_cache_the_memory_cannot_hold_is_refused_with_what_to_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_memory(tensor: torch.Tensor, progress: object) -> None:
        raise MemoryError("could not back 1 bytes with memory: Cannot allocate memory")

    monkeypatch.setattr(kv_cache, "populate_pages", no_memory)
    with pytest.raises(ConfigError, match=r"--cpu-memory-gb.*--num-blocks"):
        _host_cache(num_layers=1, num_blocks=3, prefault=True)
