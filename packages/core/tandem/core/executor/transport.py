"""Engine -> worker step inputs across processes of one machine: the payload is written once
into shared memory, and each worker gets a small note (sequence, length) on its own pipe."""

from __future__ import annotations

from multiprocessing.shared_memory import SharedMemory


class ShmBroadcastWriter:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._shm = SharedMemory(create=True, size=capacity)
        self.seq = 0

    @property
    def name(self) -> str:
        return self._shm.name

    def write(self, payload: bytes) -> tuple[int, int]:
        """Put ``payload`` in the segment; the caller tells readers (seq, length)."""
        if len(payload) > self.capacity:
            raise ValueError(
                f"a step input of {len(payload)} bytes does not fit the {self.capacity}-byte "
                "transport; lower --max-tokens-per-batch"
            )
        assert self._shm.buf is not None
        self._shm.buf[: len(payload)] = payload
        self.seq += 1
        return self.seq, len(payload)

    def close(self) -> None:
        self._shm.close()
        self._shm.unlink()


class ShmBroadcastReader:
    def __init__(self, name: str) -> None:
        # Readers are spawned by the writer's process and share its resource tracker, so
        # attaching adds nothing to clean up: the writer unlinks the segment once.
        self._shm = SharedMemory(name=name)

    def read(self, length: int) -> bytes:
        assert self._shm.buf is not None
        return bytes(self._shm.buf[:length])

    def close(self) -> None:
        self._shm.close()
