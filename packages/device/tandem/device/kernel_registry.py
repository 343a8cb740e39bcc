"""The process-global kernel registry: each (kernel, device, variant) is registered with the
device runtime exactly once, however many worker threads ask for it at the same moment.

torch_npu_ops' registry, in the review of xLLM pull request #1894 (Qwen3.5-27B at TP=2 in one
process), let two threads both miss, both register, and the loser (error 507028) erase the
winner's entry, leaving null stubs behind. Here the first caller of a key owns its registration
and publishes the result; concurrent callers wait on the same in-flight future and reuse it; a
failed registration reaches every waiter and only ever removes its own in-flight marker, never
an entry someone else published; reads of published entries take no lock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from tandem.device.device import Device
from tandem.device.sync import REAL_SYNC, Promise, Sync

T = TypeVar("T")


@dataclass(frozen=True)
class KernelKey:
    kernel: str
    device: Device
    # e.g. the dtype, or a tiling choice: one registration per variant.
    variant: str = ""


class KernelRegistry(Generic[T]):
    def __init__(self, sync: Sync = REAL_SYNC) -> None:
        # Published entries are only ever added, never replaced or removed, so a plain dict
        # read (atomic under the GIL) needs no lock.
        self._published: dict[KernelKey, T] = {}
        self._in_flight: dict[KernelKey, Promise[T]] = {}
        self._sync = sync
        self._lock = sync.lock()
        self.registrations = 0

    def lookup(self, key: KernelKey) -> T | None:
        return self._published.get(key)

    def get(self, key: KernelKey, register: Callable[[], T]) -> T:
        """The handle for ``key``, calling ``register`` only if nobody has (or is doing so)."""
        self._sync.yield_point(f"registry.lookup {key.kernel}@{key.device}")
        handle = self._published.get(key)
        if handle is not None:
            return handle
        with self._lock:
            handle = self._published.get(key)
            if handle is not None:
                return handle
            future = self._in_flight.get(key)
            owner = future is None
            if future is None:
                future = Promise(self._sync)
                self._in_flight[key] = future
        if not owner:
            return future.result()
        try:
            self._sync.yield_point(f"registry.register {key.kernel}@{key.device}")
            handle = register()
        except BaseException as exc:
            with self._lock:
                if self._in_flight.get(key) is future:
                    del self._in_flight[key]
            future.set_exception(exc)
            raise
        with self._lock:
            self.registrations += 1
            self._published.setdefault(key, handle)
            handle = self._published[key]
            if self._in_flight.get(key) is future:
                del self._in_flight[key]
        future.set_result(handle)
        return handle

    def __len__(self) -> int:
        return len(self._published)


_PROCESS_REGISTRY: KernelRegistry[Any] = KernelRegistry()


def process_kernel_registry() -> KernelRegistry[Any]:
    """The one registry of this process (kernel registration is process-global on NPUs)."""
    return _PROCESS_REGISTRY
