"""Tearing communicators down: each is destroyed on a thread bound to its device, every one is
attempted even after a failure, and every failure is reported.

HCCL reads the calling thread's device at the top of ``HcclCommDestroy`` (CANN HCCL open source,
op_base.cc: ``hrtGetDeviceRefresh`` -> ``aclrtGetDevice``, HCCL_E_RUNTIME without one). The
executor closes communicator sets from its own thread, which never binds a device. The
stand-in keeps the ACL runtime's per-thread device, set only through its ``aclrtSetDevice``,
which the backend's binding reaches the way torch.npu.set_device reaches the real one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from harness import free_port
from tandem_hw.comm_backend import HcclBackend, LibraryBackend
from tandem_hw.comm_group import CommGroup, Communicators, DeviceBinder
from tandem_hw.comm_library import CommLibrary, CommLibraryError
from tandem_hw.hccl import HcclLibrary
from tandem_hw.launch_turns import LaunchTurns
from tandem_sim.standin_library import StandinProbe

from tandem.collectives import CollectiveTimeout, ReduceOp
from tandem.device import Device, get_runtime

RunRanks = Callable[..., list[Any]]


def on_fresh_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a new thread (no device bound, like the executor's), its result or error."""
    box: list[Any] = []

    def body() -> None:
        try:
            box.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box.append(exc)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(60)
    result = box[0]
    if isinstance(result, BaseException):
        raise result
    return result


def _communicators(
    library: CommLibrary, bind: DeviceBinder, indices: list[int]
) -> tuple[Communicators, list[CommGroup]]:
    bind(Device("cpu", indices[0]))
    comms = library.init_all(indices)
    devices = [Device("cpu", i) for i in indices]
    shared = Communicators(
        library, comms, devices, bind, LaunchTurns([str(d) for d in devices]), 60.0
    )
    groups = [
        CommGroup(library, c, r, len(comms), lambda: 1, shared, torch.device("cpu"))
        for r, c in enumerate(comms)
    ]
    return shared, groups


def test_hccl_destroy_needs_a_device_on_the_calling_thread(
    standin_path: Path, probe: StandinProbe
) -> None:
    library = HcclLibrary(standin_path)
    probe.set_device(0)
    comm = library.init_all([0])[0]
    with pytest.raises(CommLibraryError) as err:
        on_fresh_thread(lambda: library.destroy(comm))
    assert err.value.function == "HcclCommDestroy"
    assert str(err.value).endswith("call runtime api fail (code 15)")

    def bound_destroy() -> None:
        probe.set_device(3)
        library.destroy(comm)

    on_fresh_thread(bound_destroy)


def test_close_from_an_unbound_thread_destroys_every_communicator(
    library: CommLibrary, bind: DeviceBinder, probe: StandinProbe, run_ranks: RunRanks
) -> None:
    before = probe.live_comms()
    shared, groups = _communicators(library, bind, [0, 1, 2])
    run_ranks(3, lambda r: groups[r].all_reduce(torch.ones(2)))
    assert probe.live_comms() == before + 3
    on_fresh_thread(shared.close)
    assert probe.live_comms() == before
    assert shared.close_failures == []


def test_close_goes_on_after_a_failure_and_reports_each(
    library: CommLibrary,
    bind: DeviceBinder,
    probe: StandinProbe,
    caplog: pytest.LogCaptureFixture,
) -> None:
    before = probe.live_comms()
    bind(Device("cpu", 0))
    comms = library.init_all([0, 1, 2, 3])
    devices = [Device("cpu", i) for i in range(4)]
    refused = {devices[1], devices[2]}

    def flaky_bind(device: Device) -> None:
        if device in refused:
            raise RuntimeError(f"cannot bind {device}")
        bind(device)

    shared = Communicators(library, comms, devices, flaky_bind, LaunchTurns(["x"] * 4), 60.0)
    with caplog.at_level(logging.ERROR, logger="tandem_hw.comm_group"):
        on_fresh_thread(shared.close)
    assert [f.device for f in shared.close_failures] == [devices[1], devices[2]]
    assert all("cannot bind" in f.error for f in shared.close_failures)
    # The two whose threads bound their device are gone; the other two stay, reported.
    assert probe.live_comms() == before + 2
    text = caplog.text
    assert "communicator of cpu:1 was not destroyed" in text
    assert "communicator of cpu:2 was not destroyed" in text
    assert "2 of 4 communicators could not be destroyed" in text
    for comm, device in zip(comms[1:3], devices[1:3], strict=True):

        def bound_destroy(comm: int = comm, device: Device = device) -> None:
            bind(device)
            library.destroy(comm)

        on_fresh_thread(bound_destroy)
    assert probe.live_comms() == before


class _SlowInit:
    """The stand-in HCCL whose communicator creation waits until the test lets it go."""

    def __init__(self, inner: HcclLibrary) -> None:
        self.inner = inner
        self.release = threading.Event()
        self.returned = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def init_all(self, devices: list[int]) -> list[int]:
        self.release.wait(30)
        comms = self.inner.init_all(devices)
        self.returned.set()
        return comms


class _SlowBackend(LibraryBackend):
    name = "hccl"
    device_kind = "npu"


def test_a_timed_out_creation_destroys_what_it_creates_late(
    standin_path: Path, probe: StandinProbe
) -> None:
    slow = _SlowInit(HcclLibrary(standin_path))
    backend = _SlowBackend(lambda: cast(CommLibrary, slow))
    before = probe.live_comms()
    devices = [Device("cpu", 0), Device("cpu", 1)]
    with pytest.raises(CollectiveTimeout, match="cannot be interrupted"):
        backend.local_groups(devices, get_runtime("cpu"), timeout_s=0.2)
    slow.release.set()
    assert slow.returned.wait(30)
    deadline = time.monotonic() + 30
    while probe.live_comms() != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert probe.live_comms() == before


def test_every_hccl_collective_needs_a_device_on_the_calling_thread(
    standin_path: Path, probe: StandinProbe
) -> None:
    """op_base.cc reads the calling thread's device first in HcclAllReduce, HcclAllGather,
    HcclReduceScatter, HcclBroadcast and HcclBarrier, before even a count of 0 succeeds."""
    library = HcclLibrary(standin_path)
    # Tensors kept alive for the calls' whole span: the library writes through raw pointers.
    buf, out = torch.ones(4), torch.empty(4)
    send, recv = buf.data_ptr(), out.data_ptr()

    def calls(comm: int) -> dict[str, Callable[[], None]]:
        return {
            "HcclAllReduce": lambda: library.all_reduce(
                send, recv, 4, torch.float32, ReduceOp.SUM, comm, 1
            ),
            "HcclAllGather": lambda: library.all_gather(send, recv, 4, torch.float32, comm, 1),
            "HcclReduceScatter": lambda: library.reduce_scatter(
                send, recv, 0, torch.float32, ReduceOp.SUM, comm, 1
            ),
            "HcclBroadcast": lambda: library.broadcast(send, 4, torch.float32, 0, comm, 1),
            "HcclBarrier": lambda: library.barrier(comm, 1),
        }

    def bound_thread() -> None:
        # Set on a thread of its own: a device left set on pytest's thread would let later
        # tests' unbound calls through.
        probe.set_device(0)
        comm = library.init_all([0])[0]
        for function, call in calls(comm).items():
            with pytest.raises(CommLibraryError) as err:
                on_fresh_thread(call)
            assert err.value.function == function
            assert err.value.code == 15, err.value
        # The same calls from a bound thread go through (one rank: nobody to wait for).
        for call in calls(comm).values():
            call()
        library.destroy(comm)

    on_fresh_thread(bound_thread)
    assert out.tolist() == [1.0] * 4


def test_a_collective_from_a_thread_the_runtime_never_bound_fails_on_cpu(
    standin_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Groups of the hccl backend on host devices: a worker thread bound through the CPU
    runtime issues its collectives; a thread that never was (the executor's, a stray one) is
    refused, as HCCL refuses it on a card."""
    monkeypatch.setenv("HCCL_SO_PATH", str(standin_path))
    made = HcclBackend().local_groups([Device("cpu", 0)], get_runtime("cpu"), timeout_s=60)
    group = made.groups[0]
    with pytest.raises(CommLibraryError, match="HcclAllReduce failed: call runtime api fail"):
        on_fresh_thread(lambda: group.all_reduce(torch.ones(2)))

    def bound() -> torch.Tensor:
        get_runtime("cpu").bind(Device("cpu", 0))
        return group.all_reduce(torch.ones(2))

    assert on_fresh_thread(bound).tolist() == [1.0, 1.0]
    on_fresh_thread(made.communicators.close)


def test_a_root_info_group_comes_with_the_communicators_that_close_it(
    standin_path: Path, probe: StandinProbe, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The multi-process path: what process_group makes, its caller can close."""

    monkeypatch.setenv("HCCL_SO_PATH", str(standin_path))
    before = probe.live_comms()

    def join() -> Any:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
        try:
            return HcclBackend().process_group(Device("cpu", 2), get_runtime("cpu"), 0, 1, 60)
        finally:
            dist.destroy_process_group()

    made = on_fresh_thread(join)
    assert probe.live_comms() == before + 1

    def reduce() -> list[float]:
        get_runtime("cpu").bind(Device("cpu", 2))
        out: list[float] = made.group.all_reduce(torch.ones(1)).tolist()
        return out

    # On a bound thread: HCCL refuses a collective from a thread with no device set.
    assert on_fresh_thread(reduce) == [1.0]
    on_fresh_thread(made.communicators.close)
    assert probe.live_comms() == before
