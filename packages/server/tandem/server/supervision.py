"""The HTTP server's side of staying answerable: on shutdown every request in flight is
answered (aborted with an OpenAI-shaped error) before the connections drain, and once the
engine has failed the server drains and exits non-zero, so a supervisor restarts it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from socket import socket

import uvicorn

logger = logging.getLogger(__name__)

# The exit status of a server whose engine failed.
EXIT_ENGINE_FAILED = 3


class SupervisedServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        abort_all: Callable[[str], None],
        engine_failure: Callable[[], str | None],
        exit_on_engine_failure: bool,
    ) -> None:
        """``abort_all(reason)``: answer every request in flight (called first thing on
        shutdown); ``engine_failure()``: why the engine failed, None while it serves."""
        super().__init__(config)
        self._abort_all = abort_all
        self._engine_failure = engine_failure
        self._exit_on_engine_failure = exit_on_engine_failure
        self.failure: str | None = None

    async def on_tick(self, counter: int) -> bool:
        # Every 0.1 s on the server's loop: a cheap attribute read.
        if self.failure is None:
            self.failure = self._engine_failure()
            if self.failure is not None:
                if self._exit_on_engine_failure:
                    logger.error("the engine failed (%s); draining and exiting", self.failure)
                    self.should_exit = True
                else:
                    logger.error(
                        "the engine failed (%s); serving 503 until stopped "
                        "(--no-exit-on-engine-failure)",
                        self.failure,
                    )
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
