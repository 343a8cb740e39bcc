"""Connections: a cap on how many are open, below the process's open-file limit (past it, a
503 with ``Connection: close`` at once, instead of descriptors running out and the event
loop dropping connections without a word); a deadline for a request's headers (a client
that trickles them, or connects and sends nothing, is cut off); a warning in the log when
descriptors run short anyway.

uvicorn alone bounds none of these: its keep-alive timer runs only between requests and any
byte cancels it, and ``limit_concurrency`` counts connections but only answers 503 once a
request's headers have arrived on an already accepted one (the descriptor is taken)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import time
from dataclasses import dataclass, field
from typing import cast

from uvicorn.protocols.http.h11_impl import H11Protocol

from tandem.server.error_body import error_body

logger = logging.getLogger(__name__)

# Descriptors kept free beyond the cap: the server's own opened after start-up (listening
# socket, event loop: about a dozen), refused connections still being answered (a quarter of
# the reserve at most), files and pipes opened later. At least this many, or an eighth of the limit.
MIN_RESERVE = 32
# With no open-file limit, the cap is this.
UNLIMITED_CAP = 1 << 20
# How long a refused connection may stay open for its 503 to be read.
REFUSED_LINGER_S = 1.0
# One warning per this many seconds, per kind.
LOG_EVERY_S = 10.0


def open_descriptors() -> int | None:
    """How many descriptors this process has open (None where that cannot be read)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def file_limit() -> int | None:
    """The soft open-file limit, None for unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def reserve_for(limit: int) -> int:
    return max(MIN_RESERVE, limit // 8)


def connection_cap(requested: int | None, limit: int | None, in_use: int) -> tuple[int, str]:
    """The connection cap and the sentence the start-up log says about it: ``requested``
    (--max-connections) or, by default, what ``limit`` leaves after the ``in_use``
    descriptors and a reserve; a requested cap above that is lowered to it."""
    if limit is None:
        cap = requested or UNLIMITED_CAP
        return cap, f"accepting at most {cap} connections (no open-file limit)"
    reserve = reserve_for(limit)
    room = max(limit - in_use - reserve, 1)
    why = (
        f"the open-file limit is {limit}, {in_use} descriptors are in use and {reserve} are "
        "kept in reserve"
    )
    if requested is None:
        return room, f"accepting at most {room} connections: {why} (raise it with ulimit -n)"
    if requested > room:
        return room, (
            f"accepting at most {room} connections, not --max-connections {requested}: {why} "
            "(raise it with ulimit -n)"
        )
    return requested, f"accepting at most {requested} connections (--max-connections)"


def _raw_response(status: int, reason: str, message: str, extra: str = "") -> bytes:
    body = json.dumps(error_body(status, message)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n{extra}\r\n"
    )
    return head.encode() + body


@dataclass
class ConnectionGuard:
    """The limits every connection of one server shares, and its rate-limited warnings."""

    cap: int
    header_timeout_s: float
    file_limit: int | None = None
    refused: int = 0
    lingering: int = 0
    _last_log: dict[str, float] = field(default_factory=dict)

    @property
    def max_lingering(self) -> int:
        """Refused connections being answered at once, at most: a quarter of the reserve."""
        if self.file_limit is None:
            return self.cap
        return reserve_for(self.file_limit) // 4

    def warn(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last_log.get(kind, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._last_log[kind] = now
            logger.warning(message, *args)

    def check_descriptors(self) -> None:
        """A warning when few descriptors are left (called about once a second): past the
        limit the event loop drops new connections without an answer or a log line."""
        if self.file_limit is None:
            return
        in_use = open_descriptors()
        if in_use is None:
            return
        left = self.file_limit - in_use
        if left < reserve_for(self.file_limit) // 4:
            self.warn(
                "descriptors",
                "file descriptors are running short: %d of the open-file limit of %d are in "
                "use; new connections may be dropped unanswered (raise it with ulimit -n, or "
                "lower --max-connections)",
                in_use,
                self.file_limit,
            )

    def refused_response(self) -> bytes:
        message = (
            f"The server has {self.cap} connections open, its limit (--max-connections); "
            "retry shortly."
        )
        return _raw_response(503, "Service Unavailable", message, "retry-after: 1\r\n")

    def timeout_response(self) -> bytes:
        message = (
            f"The request's headers did not arrive within {self.header_timeout_s:g} s "
            "(--request-header-timeout-s)."
        )
        return _raw_response(408, "Request Timeout", message)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the connection cap and the header deadline. The guard is
    a class attribute: ``guarded_protocol(guard)`` makes the class uvicorn instantiates."""

    guard: ConnectionGuard

    _refused = False
    _header_timer: asyncio.TimerHandle | None = None
    _linger_timer: asyncio.TimerHandle | None = None
    _got_bytes = False
    _lingering = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        guard = self.guard
        if len(self.connections) >= guard.cap:
            self._refuse(transport)
            return
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm()

    def _refuse(self, transport: asyncio.BaseTransport) -> None:
        """Answer 503 at once, before any request: read nothing, hold the descriptor only
        as long as the client needs to read the answer."""
        guard = self.guard
        self._refused = True
        guard.refused += 1
        guard.warn(
            "cap",
            "refusing connections with 503: %d are open, the cap (--max-connections); "
            "%d refused so far",
            len(self.connections),
            guard.refused,
        )
        # (uvloop's transports are not asyncio.Transport subclasses.)
        self.transport = transport = cast(asyncio.Transport, transport)
        if guard.lingering >= guard.max_lingering:
            # A flood: no descriptor to spare for more answers.
            transport.abort()
            return
        guard.lingering += 1
        self._lingering = True
        transport.write(guard.refused_response())
        if transport.can_write_eof():
            transport.write_eof()
        self._linger_timer = self.loop.call_later(REFUSED_LINGER_S, transport.close)

    def _arm(self) -> None:
        if self._header_timer is None:
            self._got_bytes = False
            self._header_timer = self.loop.call_later(
                self.guard.header_timeout_s, self._headers_timed_out
            )

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self._got_bytes:
            self.transport.write(self.guard.timeout_response())
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self.cycle is None or self.cycle.response_complete:
            # Between requests: what comes now is the next request's headers (or what is
            # left of the last one's body); they get header_timeout_s from here.
            self._arm()
            self._got_bytes = True
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm()  # headers complete: the body has its own deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._refused:
            if self._lingering:
                self.guard.lingering -= 1
            if self._linger_timer is not None:
                self._linger_timer.cancel()
            return
        super().connection_lost(exc)

    def eof_received(self) -> None:
        if self._refused:
            self.transport.close()


def guarded_protocol(guard: ConnectionGuard) -> type[GuardedH11Protocol]:
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": guard})
