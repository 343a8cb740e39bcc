"""One pipeline lane's step inputs on their way to the lane's stream.

Each lane owns its stager (never shared between lanes: the bug reviewed in xLLM pull request
#1453 was a static cache, ``OneRecBatchInputBuilder::get_perf_cache``, every pipeline wrote
into). The stager packs the step's tensors into a host staging buffer it keeps between steps
(built once, grown when a step needs more), copies them into a scratch block from the worker's
shared allocator, and records the block on the lane's stream. The host can then give the block
back at once: the allocator reuses it only after the stream has run past this step, so there is
no synchronize and no use-after-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.device.scratch_allocator import ScratchAllocator, ScratchBlock, Stream
from tandem.device.sync import REAL_SYNC, Sync

_ALIGN = 64


class UseAfterFree(RuntimeError):
    """A stream read scratch memory that had been handed to someone else."""


@dataclass(frozen=True)
class Staged:
    tensors: tuple[torch.Tensor, ...]
    block: ScratchBlock
    generation: int

    def check(self) -> None:
        """Raise if the block was handed out again while this step still uses it."""
        if self.block.generation != self.generation:
            raise UseAfterFree(
                f"scratch block reused (generation {self.generation} -> "
                f"{self.block.generation}) while a stream still read it"
            )


class LaneStager:
    def __init__(self, allocator: ScratchAllocator, stream: Stream, sync: Sync = REAL_SYNC):
        self._allocator = allocator
        self._stream = stream
        self._sync = sync
        self._host = torch.empty(0, dtype=torch.uint8)

    def stage(self, tensors: Sequence[torch.Tensor]) -> Staged:
        flat = [t.reshape(-1).contiguous() for t in tensors]
        offsets: list[int] = []
        total = 0
        for t in flat:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        if self._host.numel() < total:
            self._host = torch.empty(max(total, 2 * self._host.numel()), dtype=torch.uint8)
        for t, off in zip(flat, offsets, strict=True):
            nbytes = t.numel() * t.element_size()
            # An empty tensor may have stride 0 (numpy's empty fancy index), which no dtype
            # view accepts; it has no bytes to copy anyway.
            if nbytes:
                self._host[off : off + nbytes].copy_(t.view(torch.uint8))
        self._sync.yield_point("stager.packed")
        block = self._allocator.allocate(total)
        block.storage[:total].copy_(self._host[:total], non_blocking=True)
        self._record(block)
        views = tuple(
            block.storage[off : off + t.numel() * t.element_size()].view(t.dtype).view(src.shape)
            for t, off, src in zip(flat, offsets, tensors, strict=True)
        )
        return Staged(views, block, block.generation)

    def _record(self, block: ScratchBlock) -> None:
        self._allocator.record_stream(block, self._stream)

    def release(self, staged: Staged) -> None:
        """Give the block back now; the stream's pending use keeps it from being reused."""
        self._allocator.free(staged.block)
