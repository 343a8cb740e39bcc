"""Large request and answer bodies, kept out of the server's heap.

The server keeps the memory it frees in its heap for good (tandem.device.cpu's
keep_freed_memory_in_heap: the engine allocates the same activations every step), so every
multi-MB body that passed through it as ``bytes`` raised its resident size for the rest of
its life (issue 35: +65 MiB after four 6 MB prompts, +99 MiB with their 10 MB answers). A
body past ``SPILL_BYTES`` is written instead into an anonymous memory mapping of its own,
from the 64 KiB pieces the connection delivers, and handed on as a view: to a preparation
process through its pipe, or back to the client in pieces. Closing the mapping gives its
pages back to the system at once."""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Iterator
from typing import IO

# Bodies larger than this are spilled into a mapping (and prepared in a process, see
# preparer.py); smaller ones stay ``bytes``.
SPILL_BYTES = 64 << 10
# What an answer is sent in: the connection's write buffer holds about this much at a time.
PIECE_BYTES = 64 << 10


class Spilled:
    """Up to ``capacity`` bytes in a mapping of their own. Only the pages written are
    resident; ``close`` unmaps them (or, while a view is still held, the last view's end)."""

    def __init__(self, capacity: int) -> None:
        self._map = mmap.mmap(-1, max(capacity, 1))
        self.size = 0

    @classmethod
    def read_from(cls, stream: IO[bytes], size: int) -> Spilled:
        """``size`` bytes from ``stream``; EOFError if it ends first."""
        spilled = cls(size)
        with memoryview(spilled._map) as whole:
            while spilled.size < size:
                got = stream.readinto(whole[spilled.size : size])  # type: ignore[attr-defined]
                if not got:
                    spilled.close()
                    raise EOFError
                spilled.size += got
        return spilled

    def write(self, data: bytes) -> None:
        """Append ``data`` (ValueError past the capacity)."""
        self._map.write(data)
        self.size += len(data)

    def view(self) -> memoryview:
        """The bytes written so far (release it before ``close``: ``with spilled.view()``)."""
        return memoryview(self._map)[: self.size]

    def to_bytes(self) -> bytes:
        """A copy in the heap, for code that needs ``bytes``."""
        return self._map[: self.size]

    def pieces(self) -> Iterator[bytes]:
        for start in range(0, self.size, PIECE_BYTES):
            yield self._map[start : min(start + PIECE_BYTES, self.size)]

    def __len__(self) -> int:
        return self.size

    def close(self) -> None:
        # A thread still writing a view to a pipe (its request timed out) holds the mapping
        # until it is done; the mapping is unmapped when its last view goes.
        with contextlib.suppress(BufferError):
            self._map.close()


Payload = bytes | Spilled


def payload_pieces(payload: Payload) -> Iterator[bytes]:
    if isinstance(payload, Spilled):
        yield from payload.pieces()
    else:
        yield payload
