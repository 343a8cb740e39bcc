"""The synchronization facade: every lock, condition, thread and clock that engine, executor,
worker, communicator and registry code uses comes from a ``Sync``.

Production passes ``REAL_SYNC`` (plain ``threading``). The simulator passes its own, which runs
the same code on real threads one at a time and switches between them at these calls, so
interleavings are chosen by a seed and replay exactly. ``yield_point`` marks other places
where a switch is interesting (a collective, a registry step, a runtime call).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")


class Held(Protocol):
    """Held inside a ``with`` block (locks and conditions alike)."""

    def __enter__(self) -> bool: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
        /,
    ) -> None: ...


class LockLike(Held, Protocol):
    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool: ...

    def release(self) -> None: ...


class ConditionLike(Held, Protocol):
    def wait(self, timeout: float | None = None) -> bool: ...

    def notify(self, n: int = 1) -> None: ...

    def notify_all(self) -> None: ...


class ThreadLike(Protocol):
    name: str

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None) -> None: ...


class Sync(Protocol):
    def lock(self) -> LockLike: ...

    def condition(self) -> ConditionLike: ...

    def start_thread(self, target: Callable[[], None], name: str) -> ThreadLike: ...

    def yield_point(self, label: str) -> None: ...

    def monotonic(self) -> float: ...


class ThreadingSync:
    """The real thing."""

    def lock(self) -> LockLike:
        return threading.Lock()

    def condition(self) -> ConditionLike:
        return threading.Condition()

    def start_thread(self, target: Callable[[], None], name: str) -> ThreadLike:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        return thread

    def yield_point(self, label: str) -> None:
        pass

    def monotonic(self) -> float:
        return time.monotonic()


REAL_SYNC: Sync = ThreadingSync()


class Promise(Generic[T]):
    """A result that another thread will provide, built on the facade (a Future would block
    outside the simulator's control)."""

    def __init__(self, sync: Sync = REAL_SYNC) -> None:
        self._sync = sync
        self._cond = sync.condition()
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Promise[T]], None]] = []

    def done(self) -> bool:
        return self._done

    def set_result(self, value: T) -> None:
        self._finish(value, None)

    def set_exception(self, error: BaseException) -> None:
        self._finish(None, error)

    def _finish(self, value: Any, error: BaseException | None) -> None:
        with self._cond:
            if self._done:
                raise RuntimeError("a promise is settled once")
            self._result, self._error, self._done = value, error, True
            callbacks = list(self._callbacks)
            self._cond.notify_all()
        for callback in callbacks:
            callback(self)

    def add_done_callback(self, callback: Callable[[Promise[T]], None]) -> None:
        with self._cond:
            if not self._done:
                self._callbacks.append(callback)
                return
        callback(self)

    def exception(self) -> BaseException | None:
        return self._error

    def result(self, timeout: float | None = None) -> T:
        """The value (or raise the error); TimeoutError if not settled within ``timeout``."""
        with self._cond:
            if not self._done:
                deadline = None if timeout is None else self._sync.monotonic() + timeout
                while not self._done:
                    remaining = None if deadline is None else deadline - self._sync.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError("the promise is not settled yet")
                    self._cond.wait(remaining)
        if self._error is not None:
            raise self._error
        value: T = self._result
        return value
