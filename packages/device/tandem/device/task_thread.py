"""A task thread: calls run one after another, in submission order, on a thread of its own. It is
what a device stream is on CPU (work queued now runs after everything queued before it), and
what a worker thread is. Queue, thread and results come from the sync facade, so the simulator
can drive it."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from tandem.device.sync import REAL_SYNC, Promise, Sync

T = TypeVar("T")

_STOP = object()


class TaskThreadStopped(RuntimeError):
    """Work was submitted to a task thread that is no longer running."""


class TaskThread:
    # What a submission to a stopped task thread fails with.
    stopped_error: type[Exception] = TaskThreadStopped

    def __init__(self, name: str, sync: Sync = REAL_SYNC) -> None:
        self.name = name
        self._sync = sync
        self._calls: deque[Any] = deque()
        self._cond = sync.condition()
        self._thread = sync.start_thread(self._loop, name)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, fn: Callable[[], T]) -> Promise[T]:
        promise: Promise[T] = Promise(self._sync)
        if not self._thread.is_alive():
            promise.set_exception(self.stopped_error(f"{self.name} is not running"))
            return promise
        with self._cond:
            self._calls.append((fn, promise))
            self._cond.notify()
        return promise

    def record_event(self) -> Promise[None]:
        """Done once everything submitted so far has run (a stream event)."""
        return self.submit(lambda: None)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._calls:
                    self._cond.wait()
                item = self._calls.popleft()
            if item is _STOP:
                return
            fn, promise = item
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - the caller decides what is fatal
                promise.set_exception(exc)
            else:
                promise.set_result(result)

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._calls.append(_STOP)
            self._cond.notify()
        self._thread.join(timeout)
