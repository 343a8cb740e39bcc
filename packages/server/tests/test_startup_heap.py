"""The start-up objects leave the garbage collector's full passes."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from tandem.server.startup_heap import freeze_startup_objects


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


class _Node:
    def __init__(self) -> None:
        self.peer: _Node | None = None


def test_the_objects_alive_at_start_up_leave_the_collectors_generations(
    unfrozen: None,
) -> None:
    kept = [_Node() for _ in range(10_000)]
    # Garbage that only a full pass frees: a cycle no one refers to.
    a, b = _Node(), _Node()
    a.peer, b.peer = b, a
    del a, b
    frozen = freeze_startup_objects()
    assert frozen >= len(kept)
    # Frozen objects that die leave the count: other threads of this test process (a
    # server's, an executor's) may free some between the two reads, never freeze any.
    assert len(kept) <= gc.get_freeze_count() <= frozen
    survivors = [o for o in gc.get_objects() if isinstance(o, _Node)]
    # Frozen objects are outside every generation: a full pass no longer lists them.
    assert survivors == []
    assert len(kept) == 10_000
