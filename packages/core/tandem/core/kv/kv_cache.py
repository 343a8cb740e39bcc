"""KV cache sizing and allocation: one slab per layer for keys and one for values."""

from __future__ import annotations

import logging
import math
import mmap
import time
from dataclasses import dataclass

import torch

from tandem.core.config import CacheConfig
from tandem.core.errors import ConfigError
from tandem.device import Device, MemoryInfo
from tandem.device.cpu import advise_huge_pages, populate_pages

logger = logging.getLogger(__name__)

GIB = 1 << 30
MIB = 1 << 20


def bytes_per_block(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> int:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


def usable_cache_bytes(
    config: CacheConfig, device: Device, memory: MemoryInfo, weight_bytes: int
) -> tuple[int, str]:
    """Bytes left for caches within ``max_memory_utilization`` of the device (CPU: of the
    budget) once the weights are in, and what to change when that is too little."""
    if device.kind == "cpu":
        usable = int(config.cpu_memory_gb * GIB * config.max_memory_utilization) - weight_bytes
        hint = "raise --cpu-memory-gb or --max-memory-utilization, or pass --num-blocks"
    else:
        in_use = memory.total_bytes - memory.free_bytes
        usable = int(memory.total_bytes * config.max_memory_utilization) - in_use
        hint = "raise --max-memory-utilization, free device memory, or pass --num-blocks"
    return usable, hint


@dataclass(frozen=True)
class BlockDemand:
    """The most KV blocks the scheduler can ever hold at once, and why (said in the log)."""

    blocks: int
    reason: str
    # The demand should prefix caching be off after all (a hybrid model without room for a
    # state snapshot serves without it); None when this one does not count it.
    without_prefix_cache: BlockDemand | None = None


@dataclass(frozen=True)
class SequenceLimits:
    """What an engine lets hold KV blocks at once: how many sequences, how long each, and
    whether finished sequences' blocks stay cached for their prefixes; with, for the
    start-up log, what a sequence is and which flags bound each count (the two products
    bound them with different flags)."""

    max_seqs: int
    context_len: int
    prefix_cache: bool
    seqs: str = "sequences (--max-num-seqs)"
    length: str = "tokens (--max-model-len)"

    def block_demand(self, block_size: int) -> BlockDemand:
        return sequence_block_demand(
            self.max_seqs,
            self.context_len,
            block_size,
            self.prefix_cache,
            seqs=self.seqs,
            length=self.length,
        )


def sequence_block_demand(
    max_seqs: int,
    context_len: int,
    block_size: int,
    prefix_cache: bool,
    seqs: str = "sequences (--max-num-seqs)",
    length: str = "tokens (--max-model-len)",
) -> BlockDemand:
    """What ``max_seqs`` running sequences of ``context_len`` positions can occupy. With
    prefix caching, as much again: finished sequences' blocks stay cached until reused, and a
    pool of exactly the running demand would evict a batch's prefixes as soon as the next
    full batch runs. ``seqs`` and ``length`` name the units and their bounds in the reason."""
    per_seq = -(-context_len // block_size)
    running = max_seqs * per_seq
    reason = f"{max_seqs} {seqs} of {context_len} {length}, {per_seq} blocks each"
    if prefix_cache:
        return BlockDemand(
            2 * running,
            reason + ", twice over for the prefix cache",
            without_prefix_cache=BlockDemand(running, reason),
        )
    return BlockDemand(running, reason)


def num_blocks_for_memory(
    config: CacheConfig,
    device: Device,
    memory: MemoryInfo,
    weight_bytes: int,
    block_bytes: int,
    reserved_bytes: int = 0,
    demand: BlockDemand | None = None,
) -> int:
    """How many blocks fit in ``max_memory_utilization`` of the device (CPU: of the budget),
    beside ``reserved_bytes`` of other caches (state slots), and no more than ``demand``:
    blocks no sequence can ever hold are memory taken from everything else on the machine."""
    if config.num_blocks is not None:
        logger.info(
            "KV cache on %s: %d blocks of %d bytes (%.2f GiB), as --num-blocks says",
            device,
            config.num_blocks,
            block_bytes,
            config.num_blocks * block_bytes / GIB,
        )
        return config.num_blocks
    usable, hint = usable_cache_bytes(config, device, memory, weight_bytes)
    usable -= reserved_bytes
    if block_bytes == 0:
        raise ConfigError(
            "this model has no full-attention layers, so KV blocks cost no memory and cannot "
            "be sized from it; pass --num-blocks"
        )
    num_blocks = usable // block_bytes
    if num_blocks < 1:
        raise ConfigError(
            f"no memory left for the KV cache on {device} (one block needs {block_bytes} bytes, "
            f"{max(usable, 0)} bytes are free after the weights"
            + (" and state slots" if reserved_bytes else "")
            + f"); {hint}"
        )
    if demand is not None and demand.blocks < num_blocks:
        logger.info(
            "KV cache on %s: %d blocks of %d bytes (%.2f GiB), enough for %s; the memory "
            "budget would allow %d (pass --num-blocks for more)",
            device,
            demand.blocks,
            block_bytes,
            demand.blocks * block_bytes / GIB,
            demand.reason,
            num_blocks,
        )
        return demand.blocks
    logger.info(
        "KV cache on %s: %d blocks of %d bytes (%.2f GiB), all that the memory budget allows (%s)",
        device,
        num_blocks,
        block_bytes,
        num_blocks * block_bytes / GIB,
        "--cpu-memory-gb, --max-memory-utilization"
        if device.kind == "cpu"
        else "--max-memory-utilization",
    )
    return num_blocks


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    prefault: bool,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values), each [num_blocks + 1, block_size, kv_heads, head_dim].

    Block 0 is the null block that padded block tables point at. Everything starts zeroed:
    attention copies whole blocks, masked slots included, and a masked slot holding NaN
    from uninitialised memory would still poison the output (0 * NaN). ``prefault`` (CPU):
    back every page with memory before returning (see ``prefault_host_cache``); otherwise
    pages are backed as attention first writes them.
    """
    shape = (num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim)
    if device.type == "cpu":
        slab = zeroed_host_tensor(shape, dtype)
        if not advise_huge_pages(slab):
            logger.debug("the KV cache stays on 4 KiB pages (no madvise here)")
        if prefault:
            prefault_host_cache(slab)
    else:
        slab = torch.zeros(shape, dtype=dtype, device=device)
    return [(slab[i, 0], slab[i, 1]) for i in range(num_layers)]


def copy_rows(
    pools: list[tuple[torch.Tensor, torch.Tensor]], copies: tuple[tuple[int, int], ...]
) -> None:
    """Copy rows (source, destination) along the first dimension of both tensors of every
    layer, each in one gather and one scatter: whole KV blocks (a state snapshot's partial
    last block into the block of a sequence that starts from it), or rows of the
    linear-attention conv and recurrent state pools (kv/state_snapshots.py). No destination
    is also a source: the gather reads everything before the scatter writes."""
    if not copies or not pools:
        return
    device = pools[0][0].device
    src = torch.tensor([c[0] for c in copies], dtype=torch.int64, device=device)
    dst = torch.tensor([c[1] for c in copies], dtype=torch.int64, device=device)
    for first, second in pools:
        first.index_copy_(0, dst, first.index_select(0, src))
        second.index_copy_(0, dst, second.index_select(0, src))


def prefault_host_cache(slab: torch.Tensor) -> None:
    """Back the host KV cache's pages now, before serving, as vLLM's CPU build does by
    zero-filling its pool at start-up. Left to first use, the pages are backed inside steps:
    the pool hands out never-used blocks first (so that finished prefixes stay cached), so
    every block's first write faults until the pool has been used once, and on a cloud
    guest that measured 11-13 % of the bench workload's output rate
    (``benchmarks/results/2026-12-06-kv-prefault-zen4``). It also fails at start-up, not
    mid-serving, where the memory is not there."""
    total = slab.numel() * slab.element_size()
    began = time.monotonic()
    next_report = began + 5.0

    def report(done: int, total: int) -> None:
        nonlocal next_report
        if time.monotonic() >= next_report and done < total:
            logger.info("KV cache: %.2f of %.2f GiB backed", done / GIB, total / GIB)
            next_report = time.monotonic() + 5.0

    try:
        populate_pages(slab, report)
    except MemoryError as exc:
        raise ConfigError(
            f"the KV cache's {total / GIB:.2f} GiB could not be backed with memory ({exc}): "
            "lower --cpu-memory-gb or --max-memory-utilization, or pass --num-blocks"
        ) from exc
    logger.info(
        "KV cache: its %.2f GiB backed with memory in %.1f s before serving "
        "(--no-prefault-kv-cache leaves that to the first requests)",
        total / GIB,
        time.monotonic() - began,
    )


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A host tensor on a private anonymous mapping: the kernel hands its pages out zeroed on
    first touch (mmap(2), MAP_ANONYMOUS), so nothing is written up front and the process
    holds only the pages attention has used, where ``torch.zeros`` would touch (and keep
    resident) every byte of a pool that the scheduler may never fill."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # torch.frombuffer keeps ``mapping`` alive for as long as the tensor's storage lives.
    return torch.frombuffer(mapping, dtype=dtype, count=numel).view(shape)
