"""Fixtures for the hardware package's tests: the CPU stand-in library (built with the system C
compiler; the tests that need it skip with the reason where it cannot be built), how a test
thread binds a host device the way the backend does, and the accelerator a device-marked test
runs on (skipped with the reason where there is none)."""

from __future__ import annotations

import functools
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tandem_hw.comm_backend import thread_binder
from tandem_hw.comm_group import DeviceBinder
from tandem_hw.comm_library import CommLibrary
from tandem_hw.hccl import HcclLibrary
from tandem_hw.nccl import NcclLibrary
from tandem_sim.standin_library import StandinProbe, StandinUnavailable, build_standin_library

from tandem.device import Device, get_runtime


@pytest.fixture(scope="session")
def standin_path() -> Path:
    # One build shared by every test process of this machine (the file name carries the
    # source hash; concurrent builds rename into place).
    try:
        return build_standin_library(Path(tempfile.gettempdir()) / "tandem-standin")
    except StandinUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(params=["hccl", "nccl"])
def library(request: pytest.FixtureRequest, standin_path: Path) -> CommLibrary:
    if request.param == "hccl":
        return HcclLibrary(standin_path)
    return NcclLibrary(standin_path)


RunRanks = Callable[..., list[Any]]


@pytest.fixture
def bind(library: CommLibrary) -> DeviceBinder:
    """Binds the calling thread to a CPU device through the CPU runtime, and (HCCL) through the
    stand-in's aclrtSetDevice after it, as torch.npu.set_device reaches the ACL runtime."""
    return thread_binder(get_runtime("cpu"), library)


@pytest.fixture
def probe(standin_path: Path) -> StandinProbe:
    return StandinProbe(standin_path)


def bind_worker_thread(index: int, standin: Path) -> None:
    """Bind the calling thread to ``cpu:index`` as a worker thread is bound: the CPU runtime,
    and the stand-in's ACL after it (torch.npu.set_device reaches aclrtSetDevice on a card),
    since HCCL reads the calling thread's device in every collective."""
    get_runtime("cpu").bind(Device("cpu", index))
    StandinProbe(standin).set_device(index)


def _run_ranks(
    n: int,
    fn: Callable[[int], Any],
    timeout_s: float = 60.0,
    *,
    standin: Path,
    device_of: Callable[[int], int] = lambda rank: rank,
) -> list[Any]:
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            bind_worker_thread(device_of(rank), standin)
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test thread
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
        assert not thread.is_alive(), "a rank is still running"
    if errors:
        raise errors[0]
    return results


@pytest.fixture
def run_ranks(standin_path: Path) -> RunRanks:
    """``run_ranks(n, fn, device_of=...)``: ``fn(rank)`` on one thread per rank, all at once,
    each bound to ``cpu:device_of(rank)`` (``cpu:rank`` by default) as a worker thread is;
    results in rank order, the first error re-raised."""
    return functools.partial(_run_ranks, standin=standin_path)


def accelerator_unavailable(kind: str, needed: int = 2) -> str | None:
    """Why a test on ``needed`` devices of ``kind`` cannot run here, or None."""
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            return "torch_npu is not installed (no Ascend NPU stack on this machine)"
        count = int(torch.npu.device_count())  # type: ignore[attr-defined]
    else:
        if not torch.cuda.is_available():
            return f"no CUDA device visible to this torch ({torch.__version__})"
        count = torch.cuda.device_count()
    if count < needed:
        return f"needs {needed} {kind} devices, this machine has {count}"
    return None


@pytest.fixture(
    params=[
        pytest.param("npu", marks=pytest.mark.hw_npu),
        pytest.param("cuda", marks=pytest.mark.hw_cuda),
    ]
)
def accelerator(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    reason = accelerator_unavailable(kind)
    if reason is not None:
        pytest.skip(reason)
    return kind
