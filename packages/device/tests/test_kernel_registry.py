"""The kernel registry under real threads: one registration per key, failures reach every
waiter, nothing published is ever removed."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from functools import partial

import pytest

from tandem.device import Device, KernelKey, KernelRegistry

KEY = KernelKey("rms_norm", Device("cpu", 0), "torch.float32")


def _release_together(n: int, body: Callable[[int], object]) -> list[BaseException]:
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        barrier.wait()
        try:
            body(i)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertions
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return errors


def _first_use_round() -> None:
    registry: KernelRegistry[str] = KernelRegistry()
    calls: Counter[KernelKey] = Counter()
    got: list[str] = []
    keys = [KernelKey(f"k{j}", Device("cpu", d)) for j in range(3) for d in range(2)]

    def register(key: KernelKey) -> str:
        calls[key] += 1
        time.sleep(0.0005)  # widen the window in which a second registration could start
        return f"handle-{key.kernel}-{key.device}"

    def body(i: int) -> None:
        for key in keys:
            got.append(registry.get(key, partial(register, key)))

    assert _release_together(4, body) == []
    assert set(calls.values()) == {1} and len(calls) == len(keys)
    assert registry.registrations == len(keys) == len(registry)
    assert len(got) == 4 * len(keys)


def test_barrier_released_threads_register_each_key_once() -> None:
    for _ in range(200):
        _first_use_round()


def test_failed_registration_reaches_every_waiter_and_can_be_retried() -> None:
    registry: KernelRegistry[str] = KernelRegistry()
    attempts = Counter[str]()
    gate = threading.Event()

    def failing() -> str:
        attempts["fail"] += 1
        gate.wait(5)
        raise RuntimeError("rtFunctionRegister failed: error=507028")

    def body(i: int) -> None:
        if i == 0:
            registry.get(KEY, failing)
        else:
            time.sleep(0.05)  # arrive while the owner is registering
            gate.set()
            registry.get(KEY, failing)

    errors = _release_together(3, body)
    assert attempts["fail"] >= 1
    assert len(errors) == 3 and all("507028" in str(e) for e in errors)
    assert registry.lookup(KEY) is None
    # The failure left nothing behind: a later first use registers afresh.
    assert registry.get(KEY, lambda: "ok") == "ok"
    assert registry.lookup(KEY) == "ok"


def test_a_late_failure_never_removes_a_published_entry() -> None:
    registry: KernelRegistry[str] = KernelRegistry()
    assert registry.get(KEY, lambda: "winner") == "winner"

    def would_fail() -> str:
        raise AssertionError("a published key must not register again")

    assert registry.get(KEY, would_fail) == "winner"
    assert registry.lookup(KEY) == "winner" and registry.registrations == 1


@pytest.mark.parametrize("n", [2, 8])
def test_waiters_get_the_owners_handle(n: int) -> None:
    registry: KernelRegistry[object] = KernelRegistry()
    handles: list[object] = []
    errors = _release_together(n, lambda i: handles.append(registry.get(KEY, object)))
    assert errors == [] and len({id(h) for h in handles}) == 1
