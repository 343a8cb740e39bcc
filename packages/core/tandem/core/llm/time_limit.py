"""A time limit for Python code running on the calling thread, such as a chat template being
rendered: a thread cannot be killed, but code that traces itself can be made to raise.

While the limit holds, a trace function on this thread checks the clock every few hundred
Python events and raises ``TimeLimitExceeded`` inside the running code once it has passed.
Native code that runs long between two Python events is not interrupted (a Jinja template
only reaches native code in bounded steps: its sandbox caps ``range``)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

_CHECK_EVERY = 256


class TimeLimitExceeded(Exception):
    """The code ran past its time limit."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    deadline = time.monotonic() + seconds
    events = 0

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal events
        events += 1
        if events % _CHECK_EVERY == 0 and time.monotonic() > deadline:
            raise TimeLimitExceeded(f"ran longer than {seconds:g} s")
        return local

    def on_call(frame: FrameType, event: str, arg: Any) -> Any:
        return local(frame, event, arg)

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        yield
    finally:
        sys.settrace(previous)
