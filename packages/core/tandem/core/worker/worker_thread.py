"""A thread that runs calls for one worker, in order, and a wait that never hangs on a dead
one."""

from __future__ import annotations

from typing import TypeVar

from tandem.core.errors import EngineDeadError
from tandem.device.sync import Promise
from tandem.device.task_thread import TaskThread

T = TypeVar("T")


class WorkerThread(TaskThread):
    stopped_error = EngineDeadError

    def wait(self, promise: Promise[T], poll_s: float = 0.5) -> T:
        """The result of ``promise``; raises EngineDeadError if this thread dies first."""
        while True:
            try:
                return promise.result(timeout=poll_s)
            except TimeoutError:
                if not self.is_alive():
                    raise EngineDeadError(
                        f"worker thread {self.name} died while running a call"
                    ) from None
