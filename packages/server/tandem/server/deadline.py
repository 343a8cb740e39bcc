"""A request's deadline, counted from its arrival (--request-timeout-s): every wait of the
request (for the preparer's threads, for a grammar, for the engine) ends at the same moment,
so a request stuck behind someone else's work is answered 504 on time, and its work that
has not started yet is dropped."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from contextvars import ContextVar
from typing import TypeVar

from starlette.types import ASGIApp, Receive, Scope, Send

T = TypeVar("T")

# (deadline in event-loop time, the limit in seconds) of the request this task serves.
_DEADLINE: ContextVar[tuple[float, float] | None] = ContextVar(
    "tandem_request_deadline", default=None
)


class RequestTimedOut(Exception):
    """The request ran past the server's --request-timeout-s; its jobs were aborted."""

    def __init__(self, limit_s: float) -> None:
        super().__init__(
            f"The request ran longer than this server's limit of {limit_s:g} s "
            "(--request-timeout-s) and was stopped."
        )


class DeadlineMiddleware:
    """Stamps each HTTP request's deadline when it arrives (its headers read): the limit
    covers reading the body, preparing, queueing and generating."""

    def __init__(self, app: ASGIApp, timeout_s: float | None) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.timeout_s is None:
            await self.app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        token = _DEADLINE.set((deadline, self.timeout_s))
        try:
            await self.app(scope, receive, send)
        finally:
            _DEADLINE.reset(token)


def request_deadline() -> float | None:
    """The deadline (event-loop time) of the request being served, None without a limit."""
    current = _DEADLINE.get()
    return None if current is None else current[0]


async def before_deadline(work: Awaitable[T]) -> T:
    """``work``'s result, or RequestTimedOut once the request's deadline passes first; then
    ``work`` is cancelled (a job still queued for a thread never runs)."""
    current = _DEADLINE.get()
    if current is None:
        return await work
    deadline, limit = current
    loop = asyncio.get_running_loop()
    try:
        return await asyncio.wait_for(work, deadline - loop.time())
    except asyncio.TimeoutError:
        # The work's own timeout (a template's) is not the request's.
        if loop.time() < deadline:
            raise
        raise RequestTimedOut(limit) from None
