"""A thread that runs calls for one worker, in order, and a wait that never hangs on a dead
one. Its queue, thread and results come from the sync facade, so the simulator can drive it."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from tandem.core.errors import EngineDeadError
from tandem.device.sync import REAL_SYNC, Promise, Sync

logger = logging.getLogger(__name__)

T = TypeVar("T")

_STOP = object()


class WorkerThread:
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
            promise.set_exception(EngineDeadError(f"worker thread {self.name} is not running"))
            return promise
        with self._cond:
            self._calls.append((fn, promise))
            self._cond.notify()
        return promise

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

    def wait(self, promise: Promise[T], poll_s: float = 0.5) -> T:
        """The result of ``promise``; raises EngineDeadError if this thread dies first."""
        while True:
            try:
                return promise.result(timeout=poll_s)
            except TimeoutError:
                if not self._thread.is_alive():
                    raise EngineDeadError(
                        f"worker thread {self.name} died while running a call"
                    ) from None
