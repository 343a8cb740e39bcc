"""The physical KV blocks: reference counts, the null block, and a free list in the order
blocks were freed.

Block 0 is the null block: it is never handed out, and padded block tables point at it, so
attention never reads uninitialised memory. A freed block keeps whatever the prefix cache
knows of it until it is taken again (least recently freed first), so a freed prefix stays
findable as long as possible.

Not thread-safe on its own: the block manager's lock guards it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

NULL_BLOCK = 0


class BlockPool:
    def __init__(self, num_blocks: int, on_reuse: Callable[[int], None] | None = None) -> None:
        """``on_reuse(block)`` runs when a freed block is handed out again (the prefix cache
        forgets what the block held)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._on_reuse = on_reuse
        # Physical ids 1..num_blocks; id 0 is the null block.
        self._ref_counts = [0] * (num_blocks + 1)
        self._free: OrderedDict[int, None] = OrderedDict(
            (b, None) for b in range(1, num_blocks + 1)
        )

    @property
    def num_free(self) -> int:
        return len(self._free)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def take(self) -> int:
        """The least recently freed block, with one reference."""
        block, _ = self._free.popitem(last=False)
        if self._on_reuse is not None:
            self._on_reuse(block)
        self._ref_counts[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more reference to ``block`` (a prefix-cache hit, possibly on a freed block)."""
        if self._ref_counts[block] == 0:
            del self._free[block]
        self._ref_counts[block] += 1

    def release(self, block: int) -> None:
        """One reference fewer; the last one puts the block at the end of the free list."""
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._free[block] = None
