"""One collective call at a time per card, across the communicator sets of pipeline lanes.

CANN's HcclCommInitAll reference: "One device cannot call multiple collective operation APIs
at a time." The stand-in counts HCCL calls in flight per device and fails a second one. Sets
over the same devices take turns: one collective of one set at a time, in the same order on
every device, so ranks that block inside a call (HCCL's first call on a communicator, every
call of the stand-in) cannot wait on each other across cards.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tandem_hw.comm_backend import HcclBackend, LibraryBackend, NcclBackend
from tandem_hw.comm_library import CommLibrary
from tandem_hw.launch_turns import LaunchTurns
from tandem_sim.standin_library import StandinProbe

from tandem.collectives import CollectiveAborted, CollectiveTimeout, ProcessGroup
from tandem.collectives.backends import LocalGroups
from tandem.device import Device, get_runtime

RunRanks = Callable[..., list[Any]]
DEVICES = [Device("cpu", 0), Device("cpu", 1)]


def _backend(library: CommLibrary, standin_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("HCCL_SO_PATH", str(standin_path))
    monkeypatch.setenv("NCCL_SO_PATH", str(standin_path))
    backend: LibraryBackend = HcclBackend() if library.name == "hccl" else NcclBackend()
    return backend


def _lanes(backend: LibraryBackend, count: int) -> list[LocalGroups]:
    return [backend.local_groups(DEVICES, get_runtime("cpu"), timeout_s=60) for _ in range(count)]


def _run(
    device: Device, fn: Callable[[], Any], errors: list[BaseException], out: list[Any]
) -> threading.Thread:
    """``fn()`` on a new thread that the CPU runtime binds to ``device``, as a lane's is."""

    def body() -> None:
        try:
            get_runtime("cpu").bind(device)
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            errors.append(exc)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


def test_a_second_lane_waits_for_the_card_instead_of_calling_into_it(
    standin_path: Path, probe: StandinProbe, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lane A's rank 0 is inside HcclAllReduce on cpu:0 (waiting for its rank 1) when lane B's
    rank 0 issues its own all-reduce on cpu:0."""
    monkeypatch.setenv("HCCL_SO_PATH", str(standin_path))
    a, b = _lanes(HcclBackend(), 2)
    errors: list[BaseException] = []
    out: list[Any] = []
    a0 = _run(DEVICES[0], lambda: a.groups[0].all_reduce(torch.tensor([1.0])), errors, out)
    deadline = time.monotonic() + 10
    while probe.in_flight(0) != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert probe.in_flight(0) == 1
    b0 = _run(DEVICES[0], lambda: b.groups[0].all_reduce(torch.tensor([10.0])), errors, out)
    b0.join(0.5)
    assert not errors, errors
    assert b0.is_alive(), "lane B's rank 0 should wait for its turn"
    a1 = _run(DEVICES[1], lambda: a.groups[1].all_reduce(torch.tensor([2.0])), errors, out)
    b1 = _run(DEVICES[1], lambda: b.groups[1].all_reduce(torch.tensor([20.0])), errors, out)
    for thread in (a0, a1, b0, b1):
        thread.join(30)
        assert not thread.is_alive()
    assert not errors, errors
    assert sorted(t.item() for t in out) == [3.0, 3.0, 30.0, 30.0]
    for lane in (a, b):
        lane.communicators.close()


@pytest.mark.parametrize("library", ["hccl", "nccl"], indirect=True)
def test_lanes_issuing_at_once_never_share_a_card(
    library: CommLibrary,
    standin_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    run_ranks: RunRanks,
) -> None:
    lanes = _lanes(_backend(library, standin_path, monkeypatch), 3)
    rounds = 40

    def body(index: int) -> list[float]:
        lane, rank = divmod(index, 2)
        group: ProcessGroup = lanes[lane].groups[rank]
        return [
            group.all_reduce(torch.tensor([float(100 * lane + step + rank)])).item()
            for step in range(rounds)
        ]

    results = run_ranks(6, body, device_of=lambda index: index % 2)
    for index, values in enumerate(results):
        lane = index // 2
        assert values == [float(2 * (100 * lane + step) + 1) for step in range(rounds)]
    for made in lanes:
        made.communicators.close()


def test_an_aborted_set_gives_up_its_turn() -> None:
    turns = LaunchTurns(["cpu:0", "cpu:1"])
    aborted: dict[int, str] = {}
    holding = turns.turn(1, 1, lambda: aborted.get(1), 5)
    holding.__enter__()
    assert turns.holder == (1, 1)
    errors: list[BaseException] = []
    entered: list[Any] = []

    def other() -> None:
        with turns.turn(2, 1, lambda: aborted.get(2), 5):
            entered.append(turns.holder)

    waiter = _run(DEVICES[0], other, errors, [])
    # Set 1's second rank is waiting for its next collective when set 1 is aborted.
    second = _run(
        DEVICES[0], lambda: turns.turn(1, 2, lambda: aborted.get(1), 5).__enter__(), errors, []
    )
    time.sleep(0.2)
    assert waiter.is_alive() and not entered
    aborted[1] = "rank 1 failed"
    turns.release(1)
    waiter.join(5)
    second.join(5)
    assert entered == [(2, 1)]
    assert [type(e) for e in errors] == [CollectiveAborted]
    # Set 1's rank that was inside the call leaves a turn that is no longer its own.
    holding.__exit__(None, None, None)
    assert turns.holder == (2, 1)
    with turns.turn(2, 1, lambda: None, 5):
        pass
    assert turns.holder is None


def test_a_turn_never_granted_times_out_naming_the_holder() -> None:
    turns = LaunchTurns(["cpu:0", "cpu:1"])
    with turns.turn(7, 3, lambda: None, 5):
        errors: list[BaseException] = []
        _run(DEVICES[0], lambda: turns.turn(8, 1, lambda: None, 0.2).__enter__(), errors, []).join(
            5
        )
    assert len(errors) == 1 and isinstance(errors[0], CollectiveTimeout)
    assert "collective 3 of communicator set 7" in str(errors[0])
