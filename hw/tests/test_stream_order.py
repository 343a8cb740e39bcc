"""Every buffer a collective reads or writes is made before the stream handle is read, and
nothing but the library call follows the read.

Why it matters on NPU: the handle comes from torch_npu's ``Stream.npu_stream``, which drains
torch_npu's task queue onto the device stream (``NPUStream::stream()`` ->
``MakeSureQueueEmpty``, torch_npu/csrc/core/npu/NPUStream.cpp). A contiguous copy issued after
that read waits in the task queue while HCCL enqueues straight onto the raw stream, so the
collective can read the input before the copy lands. CUDA has no such queue, so only the order
of calls shows it: this test records framework ops (a ``TorchDispatchMode``), handle reads and
library calls in one log per rank thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
from tandem_hw.comm_group import CommGroup, Communicators, DeviceBinder
from tandem_hw.comm_library import CommLibrary
from tandem_hw.launch_turns import LaunchTurns
from torch.utils._python_dispatch import TorchDispatchMode

from tandem.collectives import ReduceOp
from tandem.device import Device

RunRanks = Callable[..., list[Any]]

STREAM = "<stream handle read>"
# Ops that only reserve memory: nothing to enqueue, so nothing to order.
ALLOCATIONS = ("aten.empty.", "aten.empty_strided.", "aten.empty_like.")

_local = threading.local()


def _log() -> list[str]:
    log: list[str] = _local.log
    return log


class OpLog(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        _log().append(str(func))
        return func(*args, **(kwargs or {}))


class LoggingLibrary:
    """The stand-in library, each collective call written to the calling thread's log."""

    def __init__(self, inner: CommLibrary) -> None:
        self._inner = inner
        self.name = inner.name
        self.has_barrier = inner.has_barrier

    def all_reduce(self, *args: Any) -> None:
        _log().append("library.all_reduce")
        self._inner.all_reduce(*args)

    def all_gather(self, *args: Any) -> None:
        _log().append("library.all_gather")
        self._inner.all_gather(*args)

    def reduce_scatter(self, *args: Any) -> None:
        _log().append("library.reduce_scatter")
        self._inner.reduce_scatter(*args)

    def broadcast(self, *args: Any) -> None:
        _log().append("library.broadcast")
        self._inner.broadcast(*args)

    def barrier(self, *args: Any) -> None:
        _log().append("library.barrier")
        self._inner.barrier(*args)

    def destroy(self, comm: int) -> None:
        self._inner.destroy(comm)

    def abort(self, comm: int) -> bool:
        return self._inner.abort(comm)


def _read_stream(rank: int) -> Callable[[], int]:
    def read() -> int:
        _log().append(STREAM)
        return 0x9000 + rank

    return read


def launches(log: list[str]) -> list[tuple[list[str], list[str]]]:
    """Per library call: the ops since the previous call up to the handle read, and the ops
    between the handle read and the call."""
    out: list[tuple[list[str], list[str]]] = []
    start = 0
    for index, entry in enumerate(log):
        if not entry.startswith("library."):
            continue
        window = log[start:index]
        assert window.count(STREAM) == 1, f"one handle read per call, got {window}"
        read = window.index(STREAM)
        out.append((window[:read], window[read + 1 :]))
        start = index + 1
    return out


@pytest.mark.parametrize("nranks", [2])
def test_buffers_are_made_before_the_stream_handle_is_read(
    library: CommLibrary, bind: DeviceBinder, run_ranks: RunRanks, nranks: int
) -> None:
    indices = list(range(nranks))
    bind(Device("cpu", 0))
    comms = library.init_all(indices)
    devices = [Device("cpu", i) for i in indices]
    logged = cast(CommLibrary, LoggingLibrary(library))
    shared = Communicators(
        logged, comms, devices, bind, LaunchTurns([str(d) for d in devices]), 60.0
    )
    groups = [
        CommGroup(logged, c, r, nranks, _read_stream(r), shared, torch.device("cpu"))
        for r, c in enumerate(comms)
    ]

    def body(rank: int) -> tuple[list[str], dict[str, torch.Tensor]]:
        _local.log = []
        g = groups[rank]
        base = torch.arange(24.0).reshape(4, 6) + rank
        out: dict[str, torch.Tensor] = {}
        with OpLog():  # type: ignore[no-untyped-call]
            # Every input is a transposed view: each call needs a contiguous copy first.
            out["all_reduce"] = g.all_reduce(base.clone().t(), ReduceOp.SUM)
            out["all_gather"] = g.all_gather(base.t())
            out["reduce_scatter"] = g.reduce_scatter(base.t())
            out["broadcast"] = g.broadcast(base.clone().t(), root=1)
            g.barrier()
        return _log(), out

    results = run_ranks(nranks, body)
    bases = [torch.arange(24.0).reshape(4, 6) + r for r in range(nranks)]
    for rank, (log, out) in enumerate(results):
        calls = launches(log)
        assert [c for c in log if c.startswith("library.")][:4] == [
            "library.all_reduce",
            "library.all_gather",
            "library.reduce_scatter",
            "library.broadcast",
        ]
        for index, (before, between) in enumerate(calls):
            stray = [op for op in between if not op.startswith(ALLOCATIONS)]
            assert not stray, f"rank {rank} call {index}: {stray} after the stream handle read"
            if index < 4:
                assert any("clone" in op or "copy" in op for op in before), (
                    f"rank {rank} call {index}: no contiguous copy before the handle read: {before}"
                )
        # The results are still right.
        total = bases[0].t().clone()
        for other in bases[1:]:
            total += other.t()
        assert torch.equal(out["all_reduce"], total)
        assert torch.equal(out["all_gather"], torch.cat([b.t() for b in bases], 0))
        assert torch.equal(out["reduce_scatter"], total.chunk(nranks)[rank])
        assert torch.equal(out["broadcast"], bases[1].t())
    shared.close()
