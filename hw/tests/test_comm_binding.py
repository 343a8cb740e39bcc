"""The HCCL and NCCL bindings against the CPU stand-in: both ways of creating communicators,
every collective, streams passed through, and the library's own error messages."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tandem_hw import hccl, nccl
from tandem_hw.comm_group import CommGroup, Communicators, DeviceBinder
from tandem_hw.comm_library import CommLibrary, CommLibraryError
from tandem_hw.ctypes_library import BoundLibrary, LibraryNotFound
from tandem_hw.launch_turns import LaunchTurns
from tandem_sim.standin_library import StandinProbe

from tandem.collectives import CollectiveAborted, ReduceOp
from tandem.device import Device

STREAM_BASE = 0x7000

RunRanks = Callable[..., list[Any]]


def _stream(rank: int) -> Callable[[], int]:
    return lambda: STREAM_BASE + rank


def make_groups(
    library: CommLibrary, comms: list[int], indices: list[int], bind: DeviceBinder
) -> list[CommGroup]:
    devices = [Device("cpu", i) for i in indices]
    shared = Communicators(
        library, comms, devices, bind, LaunchTurns([str(d) for d in devices]), 60.0
    )
    return [
        CommGroup(library, comm, rank, len(comms), _stream(rank), shared, torch.device("cpu"))
        for rank, comm in enumerate(comms)
    ]


def init_all(library: CommLibrary, bind: DeviceBinder, indices: list[int]) -> list[int]:
    """HcclCommInitAll reads the calling thread's device first, like the backend's init thread
    has it bound."""
    bind(Device("cpu", indices[0]))
    return library.init_all(indices)


@pytest.mark.parametrize("nranks", [2, 4])
def test_init_all_collectives_match_torch(
    library: CommLibrary,
    bind: DeviceBinder,
    probe: StandinProbe,
    run_ranks: RunRanks,
    nranks: int,
) -> None:
    devices = [3 + 2 * r for r in range(nranks)]
    comms = init_all(library, bind, devices)
    assert [probe.comm_device(c) for c in comms] == devices
    assert [probe.comm_rank(c) for c in comms] == list(range(nranks))
    groups = make_groups(library, comms, devices, bind)
    inputs = [torch.randn(6, 4, generator=torch.Generator().manual_seed(r)) for r in range(nranks)]

    def body(rank: int) -> dict[str, torch.Tensor]:
        g = groups[rank]
        out = {"sum": g.all_reduce(inputs[rank].clone())}
        out["max"] = g.all_reduce(torch.tensor([rank * 7 % 5], dtype=torch.int64), ReduceOp.MAX)
        out["i32"] = g.all_reduce(torch.tensor([rank, 1], dtype=torch.int32))
        out["bf16"] = g.all_reduce(inputs[rank].to(torch.bfloat16))
        out["f16"] = g.all_reduce(inputs[rank].to(torch.float16))
        # Non-contiguous input: the group reduces a contiguous copy and writes back.
        strided = inputs[rank].clone().t()
        out["strided"] = g.all_reduce(strided)
        out["gather0"] = g.all_gather(inputs[rank][:2])
        out["gather1"] = g.all_gather(inputs[rank][:2], dim=1)
        out["scatter"] = g.reduce_scatter(
            torch.arange(nranks * 3.0).reshape(nranks, 3) * (rank + 1)
        )
        out["bcast"] = g.broadcast(torch.full((5,), float(rank)), root=nranks - 1)
        g.barrier()
        out["bf16_bcast"] = g.broadcast(torch.full((2,), rank, dtype=torch.bfloat16), root=1)
        out["f64_gather"] = g.all_gather(torch.tensor([rank + 0.5], dtype=torch.float64))
        return out

    results = run_ranks(nranks, body)
    total = sum(inputs[1:], inputs[0].clone())
    scale = sum(range(1, nranks + 1))
    for rank, out in enumerate(results):
        assert torch.equal(out["sum"], total)
        assert out["max"].item() == max(r * 7 % 5 for r in range(nranks))
        assert out["i32"].tolist() == [sum(range(nranks)), nranks]
        # Half precision: rounded after every addition, in rank order, as torch's ``+=``.
        for key, dtype in (("bf16", torch.bfloat16), ("f16", torch.float16)):
            expected = inputs[0].to(dtype)
            for other in inputs[1:]:
                expected += other.to(dtype)
            assert out[key].dtype == dtype and torch.equal(out[key], expected), key
        assert torch.equal(out["strided"], total.t())
        assert torch.equal(out["gather0"], torch.cat([x[:2] for x in inputs], 0))
        assert torch.equal(out["gather1"], torch.cat([x[:2] for x in inputs], 1))
        expected_scatter = (torch.arange(nranks * 3.0).reshape(nranks, 3) * scale)[rank : rank + 1]
        assert torch.equal(out["scatter"], expected_scatter)
        assert out["bcast"].tolist() == [float(nranks - 1)] * 5
        assert out["bf16_bcast"].tolist() == [1.0, 1.0]
        assert out["f64_gather"].tolist() == [r + 0.5 for r in range(nranks)]
        # Each rank issued on its own stream, and the handle reached the library.
        assert probe.last_stream(comms[rank]) == STREAM_BASE + rank
    assert all(g.sequence == 13 for g in groups)
    groups[0]._communicators.close()
    assert not groups[0]._communicators.close_failures


def test_sums_are_added_in_rank_order(
    library: CommLibrary, bind: DeviceBinder, run_ranks: RunRanks
) -> None:
    """Rounding shows the order: (1e8 + 1) - 1e8 differs from 1e8 + (1 - 1e8) in float32."""
    groups = make_groups(library, init_all(library, bind, [0, 1, 2]), [0, 1, 2], bind)
    values = [1e8, 1.0, -1e8]
    out = run_ranks(3, lambda r: groups[r].all_reduce(torch.tensor([values[r]])))
    expected = (torch.tensor([1e8]) + torch.tensor([1.0])) + torch.tensor([-1e8])
    assert all(torch.equal(o, expected) for o in out)
    groups[0]._communicators.close()


def test_root_info_path_joins_ranks_of_one_clique(
    library: CommLibrary, bind: DeviceBinder, probe: StandinProbe, run_ranks: RunRanks
) -> None:
    bind(Device("cpu", 0))
    unique_id = library.unique_id()

    def join(rank: int) -> int:
        # Each rank's communicator lives on its thread's device, as HcclCommInitRootInfo's does.
        bind(Device("cpu", 4 + rank))
        return library.init_rank(2, unique_id, rank)

    comms = run_ranks(2, join)
    if library.name == "hccl":
        assert [probe.comm_device(c) for c in comms] == [4, 5]
    groups = make_groups(library, comms, [4, 5], bind)
    out = run_ranks(2, lambda r: groups[r].all_gather(torch.tensor([r + 10])))
    assert [o.tolist() for o in out] == [[10, 11], [10, 11]]
    groups[0]._communicators.close()


def test_a_failing_call_raises_with_the_library_message(
    library: CommLibrary, bind: DeviceBinder
) -> None:
    comm = init_all(library, bind, [0])[0]
    buf = torch.zeros(4)
    with pytest.raises(CommLibraryError) as err:
        if library.name == "hccl":
            # A null stream: op_base.cc checks it with CHK_PTR_NULL.
            library.all_reduce(buf.data_ptr(), buf.data_ptr(), 4, torch.float32, ReduceOp.SUM,
                               comm, 0)  # fmt: skip
        else:
            # A null communicator (NCCL takes a null stream: CUDA's default stream).
            library.all_reduce(buf.data_ptr(), buf.data_ptr(), 4, torch.float32, ReduceOp.SUM,
                               0, 1)  # fmt: skip
    expected = (
        "empty pointer (code 2)"
        if library.name == "hccl"
        else "invalid argument (run with NCCL_DEBUG=WARN for details) (code 4)"
    )
    assert str(err.value).endswith(expected)
    assert err.value.function in ("HcclAllReduce", "ncclAllReduce")
    with pytest.raises(CommLibraryError, match=r"(HcclCommInitAll|ncclCommInitAll) failed"):
        library.init_all([1, 1])  # the same device twice
    with pytest.raises(CommLibraryError, match=r"InitRootInfo|InitRank"):
        library.init_rank(2, library.unique_id(), 5)  # rank outside the clique
    library.destroy(comm)


def test_a_missing_rank_times_out_instead_of_hanging(
    library: CommLibrary, bind: DeviceBinder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANDEM_STANDIN_TIMEOUT_S", "1")
    groups = make_groups(library, init_all(library, bind, [0, 1]), [0, 1], bind)
    with pytest.raises(CommLibraryError, match=r"timeout|remote process"):
        groups[0].all_reduce(torch.ones(3))


def test_abort_fails_later_collectives_and_releases_blocked_ranks(
    library: CommLibrary, bind: DeviceBinder
) -> None:
    comms = init_all(library, bind, [0, 1])
    groups = make_groups(library, comms, [0, 1], bind)
    shared = groups[0]._communicators
    if library.name == "nccl":
        # ncclCommAbort releases a rank blocked in a collective.
        errors: list[BaseException] = []

        def blocked() -> None:
            try:
                groups[0].all_reduce(torch.ones(2))
            except CommLibraryError as exc:
                errors.append(exc)

        thread = threading.Thread(target=blocked)
        thread.start()
        time.sleep(0.3)
        shared.abort("rank 1 failed")
        thread.join(10)
        assert not thread.is_alive() and errors
    else:
        shared.abort("rank 1 failed")
    with pytest.raises(CollectiveAborted, match="rank 1 failed"):
        groups[1].all_reduce(torch.ones(2))
    shared.close()


def test_hccl_library_is_found_from_the_cann_install(standin_path: Path, tmp_path: Path) -> None:
    lib64 = tmp_path / "cann" / "lib64"
    lib64.mkdir(parents=True)
    shutil.copy(standin_path, lib64 / "libhccl.so")
    found = hccl.find_hccl_library({"ASCEND_HOME_PATH": str(tmp_path / "cann")})
    assert found == lib64 / "libhccl.so"
    found = hccl.find_hccl_library({"ASCEND_TOOLKIT_HOME": str(tmp_path / "cann")})
    assert found == lib64 / "libhccl.so"
    # The explicit path wins over the install.
    assert (
        hccl.find_hccl_library(
            {"HCCL_SO_PATH": str(standin_path), "ASCEND_HOME_PATH": str(tmp_path / "cann")}
        )
        == standin_path
    )


def test_missing_libraries_say_where_to_point() -> None:
    if any((root / "lib64" / "libhccl.so").exists() for root in hccl.DEFAULT_CANN_ROOTS):
        pytest.skip("this machine has a CANN install at a default place")
    with pytest.raises(LibraryNotFound, match="HCCL_SO_PATH") as err:
        hccl.find_hccl_library({})
    assert "set_env.sh" in str(err.value)
    # Both default roots are tried, the newer layout first.
    message = str(err.value)
    new, old = "/usr/local/Ascend/cann/lib64", "/usr/local/Ascend/ascend-toolkit/latest/lib64"
    assert new in message and old in message and message.index(new) < message.index(old)
    with pytest.raises(LibraryNotFound, match="is not a file"):
        hccl.find_hccl_library({"HCCL_SO_PATH": "/nonexistent/libhccl.so"})
    with pytest.raises(LibraryNotFound, match="is not a file"):
        nccl.find_nccl_library({"NCCL_SO_PATH": "/nonexistent/libnccl.so.2"})


def test_a_library_without_a_symbol_fails_at_load(standin_path: Path) -> None:
    libc = "libc.so.6"
    with pytest.raises(LibraryNotFound, match="does not export HcclGetErrorString"):
        BoundLibrary(libc, hccl.FUNCTIONS)
    with pytest.raises(LibraryNotFound, match="cannot load"):
        BoundLibrary("/nonexistent/libhccl.so", hccl.FUNCTIONS)
