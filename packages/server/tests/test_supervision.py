"""A server whose engine failed answers with the engine's error for a moment before it
drains and exits (requests already on their way get that answer, not a reset); with
--no-exit-on-engine-failure it never exits on its own."""

from __future__ import annotations

import asyncio

import uvicorn
from fastapi import FastAPI

from tandem.server.supervision import EXIT_ENGINE_FAILED, SupervisedServer


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _server(failure: list[str | None], clock: _Clock, exit_on_failure: bool) -> SupervisedServer:
    return SupervisedServer(
        uvicorn.Config(FastAPI()),
        abort_all=lambda reason: None,
        engine_failure=lambda: failure[0],
        exit_on_engine_failure=exit_on_failure,
        answer_after_failure_s=1.0,
        clock=clock,
    )


def test_exits_once_the_answer_window_after_the_failure_has_passed() -> None:
    failure: list[str | None] = [None]
    clock = _Clock()
    server = _server(failure, clock, exit_on_failure=True)
    assert not asyncio.run(server.on_tick(1))
    failure[0] = "rank 1 failed"
    clock.now += 5.0  # the engine's failure is seen from this tick on, not earlier
    assert not asyncio.run(server.on_tick(2))
    assert server.failure == "rank 1 failed" and server.exit_code == EXIT_ENGINE_FAILED
    clock.now += 0.9
    assert not asyncio.run(server.on_tick(3))
    clock.now += 0.1
    assert asyncio.run(server.on_tick(4))


def test_keeps_serving_without_exit_on_engine_failure() -> None:
    failure: list[str | None] = ["rank 1 failed"]
    clock = _Clock()
    server = _server(failure, clock, exit_on_failure=False)
    for tick in range(1, 4):
        clock.now += 10.0
        assert not asyncio.run(server.on_tick(tick))
    assert server.exit_code == EXIT_ENGINE_FAILED
