"""A thread that runs calls for one worker, in order, and a wait that never hangs on a dead one."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from tandem.core.errors import EngineDeadError

logger = logging.getLogger(__name__)

T = TypeVar("T")

_STOP = object()


class WorkerThread:
    def __init__(self, name: str) -> None:
        self.name = name
        self._calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        if not self._thread.is_alive():
            future.set_exception(EngineDeadError(f"worker thread {self.name} is not running"))
            return future
        self._calls.put((fn, future))
        return future

    def _loop(self) -> None:
        while True:
            item = self._calls.get()
            if item is _STOP:
                return
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - the caller decides what is fatal
                future.set_exception(exc)

    def stop(self, timeout: float = 5.0) -> None:
        self._calls.put(_STOP)
        self._thread.join(timeout)

    def wait(self, future: Future[T], poll_s: float = 0.5) -> T:
        """The result of ``future``; raises EngineDeadError if this thread dies first."""
        while True:
            try:
                return future.result(timeout=poll_s)
            except FutureTimeout:
                if not self._thread.is_alive():
                    raise EngineDeadError(
                        f"worker thread {self.name} died while running a call"
                    ) from None
