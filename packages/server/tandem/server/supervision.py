"""The HTTP server's side of staying answerable: on shutdown every request in flight is
answered (aborted with an OpenAI-shaped error) before the connections drain, and once the
engine has failed the server answers with its error for a moment, then drains and exits
non-zero, so a supervisor restarts it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from socket import socket

import uvicorn

logger = logging.getLogger(__name__)

# The exit status of a server whose engine failed.
EXIT_ENGINE_FAILED = 3
# How long a server whose engine failed keeps answering (every request fails with the
# engine's error) before it drains and exits. Requests already on their way, connected but
# not read yet, get that answer; stopping at once closed them unanswered (a connection reset
# to the client), which a loaded 2-core host showed with 8 requests sent together.
ANSWER_AFTER_FAILURE_S = 1.0


class SupervisedServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        abort_all: Callable[[str], None],
        engine_failure: Callable[[], str | None],
        exit_on_engine_failure: bool,
        answer_after_failure_s: float = ANSWER_AFTER_FAILURE_S,
        clock: Callable[[], float] = time.monotonic,
        every_second: Callable[[], None] | None = None,
    ) -> None:
        """``abort_all(reason)``: answer every request in flight (called first thing on
        shutdown); ``engine_failure()``: why the engine failed, None while it serves;
        ``every_second()``: a cheap check run about once a second (descriptors left)."""
        super().__init__(config)
        self._abort_all = abort_all
        self._engine_failure = engine_failure
        self._exit_on_engine_failure = exit_on_engine_failure
        self._answer_after_failure_s = answer_after_failure_s
        self._clock = clock
        self._failed_at = 0.0
        self.failure: str | None = None
        self._every_second = every_second

    async def on_tick(self, counter: int) -> bool:
        # Every 0.1 s on the server's loop: a cheap attribute read.
        if self._every_second is not None and counter % 10 == 0:
            self._every_second()
        if self.failure is None:
            self.failure = self._engine_failure()
            if self.failure is not None:
                self._failed_at = self._clock()
                if self._exit_on_engine_failure:
                    logger.error(
                        "the engine failed (%s); answering with its error for %.1f s, "
                        "then draining and exiting",
                        self.failure,
                        self._answer_after_failure_s,
                    )
                else:
                    logger.error(
                        "the engine failed (%s); serving 503 until stopped "
                        "(--no-exit-on-engine-failure)",
                        self.failure,
                    )
        if (
            self.failure is not None
            and self._exit_on_engine_failure
            and self._clock() - self._failed_at >= self._answer_after_failure_s
        ):
            self.should_exit = True
        should_exit: bool = await super().on_tick(counter)
        return should_exit

    async def shutdown(self, sockets: list[socket] | None = None) -> None:
        # Before uvicorn waits for the connections: a request still generating would
        # otherwise be cut off when the grace period ends, without an error or [DONE].
        self._abort_all("the server is shutting down")
        await super().shutdown(sockets)

    @property
    def exit_code(self) -> int:
        return EXIT_ENGINE_FAILED if self.failure is not None else 0
