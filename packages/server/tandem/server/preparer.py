"""Where the slow, CPU-bound part of a request runs (rendering a chat template, tokenizing,
decoding an echoed prompt): a few threads of its own, never the event loop, so /health and
every other request keep being answered while one is prepared."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from tandem.server.deadline import before_deadline

T = TypeVar("T")


class RequestPreparer:
    def __init__(self, threads: int = 4) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tandem-prepare")

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on one of the threads. A caller that goes away, or whose request's
        deadline passes (RequestTimedOut), stops waiting, and ``fn`` never runs if it had
        not started; once started it runs to its end (each job is bounded: by the input
        size limits, and templates by their time limit)."""
        return await before_deadline(asyncio.get_running_loop().run_in_executor(self._pool, fn))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
