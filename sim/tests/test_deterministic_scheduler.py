"""The deterministic scheduler: seeds fix interleavings, recordings replay, deadlocks and
stray blocking are reported instead of hanging."""

from __future__ import annotations

import threading
from functools import partial

from tandem_sim import PCT, DeterministicScheduler, Outcome, RandomWalk, Replay
from tandem_sim.strategies import Strategy


def _ping_pong(s: DeterministicScheduler, log: list[str]) -> None:
    lock = s.lock()

    def worker(name: str) -> None:
        for i in range(3):
            with lock:
                log.append(f"{name}{i}")
            s.yield_point(f"{name} after {i}")

    threads = [s.start_thread(partial(worker, n), n) for n in ("a", "b", "c")]
    for t in threads:
        t.join()


def _run(strategy: Strategy, body: object) -> tuple[Outcome, list[str]]:
    log: list[str] = []
    s = DeterministicScheduler(strategy, watchdog_s=5)
    outcome = s.run(lambda: body(s, log))  # type: ignore[operator]
    return outcome, log


def test_same_seed_same_interleaving_and_replay() -> None:
    first, log1 = _run(RandomWalk(seed=7), _ping_pong)
    again, log2 = _run(RandomWalk(seed=7), _ping_pong)
    assert first.ok and again.ok
    assert log1 == log2 and first.decisions == again.decisions
    others = {tuple(_run(RandomWalk(seed=s), _ping_pong)[1]) for s in range(10)}
    assert len(others) > 1, "different seeds should explore different interleavings"
    replayed, log3 = _run(Replay(first.decisions), _ping_pong)
    assert replayed.ok and log3 == log1 and replayed.decisions == first.decisions


def _lock_order(s: DeterministicScheduler, log: list[str]) -> None:
    a, b = s.lock(), s.lock()

    def one() -> None:
        with a:
            s.yield_point("one holds a")
            with b:
                log.append("one")

    def two() -> None:
        with b:
            s.yield_point("two holds b")
            with a:
                log.append("two")

    t1, t2 = s.start_thread(one, "one"), s.start_thread(two, "two")
    t1.join()
    t2.join()


def test_lock_order_deadlock_is_found_and_reported() -> None:
    found = None
    for seed in range(50):
        outcome, _ = _run(PCT(seed=seed, depth=2, steps=30), _lock_order)
        if not outcome.ok:
            found = outcome
            break
    assert found is not None and found.deadlock is not None
    assert "one waits on lock2 held by two" in found.deadlock
    assert "two waits on lock1 held by one" in found.deadlock
    # The recorded schedule replays to the same deadlock.
    replayed, _ = _run(Replay(found.decisions), _lock_order)
    assert replayed.deadlock == found.deadlock


def test_timed_waits_advance_virtual_time() -> None:
    def body(s: DeterministicScheduler, log: list[str]) -> None:
        cond = s.condition()
        with cond:
            notified = cond.wait(timeout=30.0)
        log.append(f"{notified} {s.monotonic():.0f}")

    outcome, log = _run(RandomWalk(seed=0), body)
    assert outcome.ok and log == ["False 30"]


def test_blocking_outside_the_facade_is_reported() -> None:
    raw = threading.Event()

    def body(s: DeterministicScheduler, log: list[str]) -> None:
        s.yield_point("about to block on a raw event")
        raw.wait(3)  # not a facade call: the scheduler cannot switch away

    s = DeterministicScheduler(RandomWalk(seed=0), watchdog_s=0.5)
    outcome = s.run(lambda: body(s, []))
    raw.set()
    assert outcome.stuck is not None and "main" in outcome.stuck
    assert "about to block on a raw event" in outcome.stuck
