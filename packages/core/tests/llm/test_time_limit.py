"""The chat template's time limit counts the CPU time its thread uses, with a wall-clock
backstop (issue 35: a wall-clock limit refused legitimate chats whenever a busy machine or
a lower-priority preparation process made them wait to run)."""

from __future__ import annotations

import threading
import time

import pytest

from tandem.core.llm.time_limit import TimeLimitExceeded, time_limit


def _spin(seconds: float) -> None:
    """Python work for ``seconds`` of this thread's CPU time."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


def test_busy_code_is_stopped_once_it_used_its_cpu_time() -> None:
    """Measured in this thread's CPU time, as the limit is: on a loaded machine (the suite
    beside a CPU hog) the thread got less than 0.2 s of CPU in 1.2 s, and the default
    backstop, not the CPU limit, ended it. The backstop here is out of the way."""
    started = time.thread_time()
    with pytest.raises(TimeLimitExceeded, match="CPU time"), time_limit(0.2, wall_s=600):
        _spin(5.0)
    assert time.thread_time() - started < 1.0


def test_time_spent_waiting_to_run_does_not_count() -> None:
    """Code that waits (here for a lock another thread holds, as a template waits for the
    GIL or a busy core) for longer than its limit finishes: only its work counts. On the old
    code (a wall-clock limit) this raised."""
    held = threading.Lock()
    held.acquire()
    threading.Timer(0.6, held.release).start()

    def wait_in_python() -> None:
        while not held.acquire(timeout=0.01):
            pass
        held.release()

    # The backstop out of the way: on a loaded machine the 0.1 s of work alone can take
    # longer than the default 1.8 s on the clock.
    with time_limit(0.3, wall_s=600):
        wait_in_python()
        _spin(0.1)


def _sleep_for_ever() -> None:
    while True:
        time.sleep(0.001)


def test_code_that_makes_no_progress_meets_the_wall_clock_backstop() -> None:
    # (The limit traces the functions called under it, as a template's rendering is.)
    started = time.monotonic()
    with pytest.raises(TimeLimitExceeded, match="on the clock"), time_limit(10.0, wall_s=0.3):
        _sleep_for_ever()
    assert 0.3 <= time.monotonic() - started < 3
