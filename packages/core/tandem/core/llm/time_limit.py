"""A time limit for Python code running on the calling thread, such as a chat template being
rendered: a thread cannot be killed, but code that traces itself can be made to raise.

The limit counts the CPU time of the calling thread (``time.thread_time``), not the clock:
a template rendered on a busy machine, in a lower-priority preparation process or on a
thread that waits for the GIL behind the engine's threads is not stopped for the time it
spent waiting to run, only for the work it did. A wall-clock backstop (``wall_s``, by
default ``WALL_FACTOR`` times the limit) still stops code that makes no progress at all
(one that sleeps, or is starved of the CPU for good).

While the limit holds, a trace function on this thread checks both clocks every few hundred
Python events and raises ``TimeLimitExceeded`` inside the running code once either has
passed. Native code that runs long between two Python events is not interrupted (a Jinja
template only reaches native code in bounded steps: its sandbox caps ``range``)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

_CHECK_EVERY = 256
# The wall-clock backstop, as a multiple of the CPU-time limit: room for a process that
# gets a sixth of a core (two busy cores shared with the engine and three other jobs).
WALL_FACTOR = 6.0


class TimeLimitExceeded(Exception):
    """The code ran past its time limit."""


@contextmanager
def time_limit(seconds: float, wall_s: float | None = None) -> Iterator[None]:
    """Raise TimeLimitExceeded in the code under the ``with`` once it has used ``seconds``
    of this thread's CPU time, or ``wall_s`` seconds have passed (``WALL_FACTOR`` x
    ``seconds`` by default)."""
    wall = WALL_FACTOR * seconds if wall_s is None else wall_s
    cpu_deadline = time.thread_time() + seconds
    wall_deadline = time.monotonic() + wall
    events = 0

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal events
        events += 1
        if events % _CHECK_EVERY == 0:
            if time.thread_time() > cpu_deadline:
                raise TimeLimitExceeded(f"used more than {seconds:g} s of CPU time")
            if time.monotonic() > wall_deadline:
                raise TimeLimitExceeded(f"took more than {wall:g} s on the clock")
        return local

    def on_call(frame: FrameType, event: str, arg: Any) -> Any:
        return local(frame, event, arg)

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        yield
    finally:
        sys.settrace(previous)
