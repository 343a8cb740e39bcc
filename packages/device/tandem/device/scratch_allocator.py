"""A caching allocator for scratch buffers that streams read after the host let go of them.

Blocks live in pools keyed by the stream they were allocated on. Reuse on that stream is safe
by stream order. A block another stream uses must be recorded on it (``record_stream``, the
caching allocator's semantics): freeing then records an event on every such stream, and the
block is handed out again only once those events have passed. The host never waits: no
synchronize on free, and a block still in use is simply skipped.

Every hand-out bumps the block's ``generation``, so a reader that remembers the generation it
was given can tell when its memory was handed to someone else (the simulator's use-after-free
check).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tandem.device.sync import REAL_SYNC, Sync

# Sizes round up to this many bytes, so steps of similar shape share blocks.
_GRANULE = 512


class Event(Protocol):
    def done(self) -> bool: ...


class Stream(Protocol):
    """An ordered queue of device work (see ``TaskThread``)."""

    def record_event(self) -> Event:
        """An event that is done once all work queued so far has run."""
        ...


# The pool of blocks allocated outside any stream (the host's default stream).
HOST = "host"


@dataclass(eq=False)
class ScratchBlock:
    storage: torch.Tensor
    pool: Hashable
    generation: int = 0
    # Streams other than the allocating one that use this block.
    used_on: list[Stream] = field(default_factory=list)
    # Events that must pass before the block may be handed out again.
    pending: list[Event] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return int(self.storage.numel())

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        count = 1
        for n in shape:
            count *= n
        nbytes = count * torch.empty(0, dtype=dtype).element_size()
        return self.storage[:nbytes].view(dtype).view(shape)


class ScratchAllocator:
    def __init__(self, device: torch.device, sync: Sync = REAL_SYNC) -> None:
        self.device = device
        self._lock = sync.lock()
        self._free: dict[Hashable, list[ScratchBlock]] = {}
        self.blocks_created = 0

    def allocate(self, nbytes: int, pool: Hashable = HOST) -> ScratchBlock:
        """A block of at least ``nbytes`` from ``pool`` that no stream still uses."""
        size = max(_GRANULE, -(-nbytes // _GRANULE) * _GRANULE)
        with self._lock:
            candidates = self._free.setdefault(pool, [])
            for i, block in enumerate(candidates):
                if block.nbytes >= size and all(e.done() for e in block.pending):
                    del candidates[i]
                    block.pending = []
                    block.generation += 1
                    return block
            self.blocks_created += 1
        storage = torch.empty(size, dtype=torch.uint8, device=self.device)
        return ScratchBlock(storage=storage, pool=pool, generation=1)

    def record_stream(self, block: ScratchBlock, stream: Stream) -> None:
        """``stream`` reads or writes ``block``: do not reuse it before that work has run."""
        with self._lock:
            if all(s is not stream for s in block.used_on):
                block.used_on.append(stream)

    def free(self, block: ScratchBlock) -> None:
        """Give ``block`` back now; it is reused once every recorded stream has passed here."""
        events = [stream.record_event() for stream in block.used_on]
        with self._lock:
            block.pending = events
            block.used_on = []
            self._free.setdefault(block.pool, []).append(block)
