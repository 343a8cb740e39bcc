"""The prefix cache: full KV blocks found by a hash chain over their tokens and every token
before them, so two prompts that share a prefix share its blocks."""

from __future__ import annotations

from collections.abc import Sequence


def block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: int | None, start: int,
                 stop: int) -> list[int]:  # fmt: skip
    """Hashes of full blocks ``start..stop-1`` of ``token_ids``, chained from ``parent``
    (the hash of block ``start - 1``, or None)."""
    hashes: list[int] = []
    for i in range(start, stop):
        parent = block_hash(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]))
        hashes.append(parent)
    return hashes


class PrefixCache:
    def __init__(self) -> None:
        self._hash_to_block: dict[int, int] = {}
        self._block_to_hash: dict[int, int] = {}

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Blocks holding the longest cached prefix of the chain ``hashes``."""
        hits: list[int] = []
        for h in hashes:
            block = self._hash_to_block.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def holds(self, h: int) -> bool:
        return h in self._hash_to_block

    def hash_of(self, block: int) -> int:
        return self._block_to_hash[block]

    def publish(self, h: int, block: int) -> None:
        """``block`` now holds the full block with chain hash ``h`` (first publisher wins)."""
        if h not in self._hash_to_block and block not in self._block_to_hash:
            self._hash_to_block[h] = block
            self._block_to_hash[block] = h

    def forget(self, block: int) -> None:
        """``block`` is about to hold other tokens."""
        old = self._block_to_hash.pop(block, None)
        if old is not None and self._hash_to_block.get(old) == block:
            del self._hash_to_block[old]
