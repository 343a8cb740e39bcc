"""The stand-in takes the data types the libraries document, refuses the others the way they
do, and speaks their error strings, so a dtype the engine sends a real card fails here too.

Expected values are transcribed here, independently of the stand-in's own table:

HCCL, CANN 8.5 HCCL API reference, Atlas A2 / A3 training and inference products:
  HcclAllReduce, HcclReduceScatter: int8, int16, int32, int64, float16, float32, bfp16;
    "prod" does not support int16 or bfp16.
  HcclAllGather, HcclBroadcast: int8, uint8, int16, uint16, int32, uint32, int64, uint64,
    float16, float32, float64, bfp16.
  An unsupported type or op fails with HCCL_E_NOT_SUPPORT (op_base.cc, HcomCheckDataType /
  HcomCheckReduceDataType). Error strings: op_base.cc HcclGetErrorString.
NCCL 2.20, nccl.h: every ncclDataType_t (Int8 .. Bfloat16) for every collective and reduction;
  error strings of src/init.cc ncclGetErrorString.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tandem_hw import hccl
from tandem_hw.comm_backend import thread_binder
from tandem_hw.comm_group import CommGroup, Communicators, DeviceBinder
from tandem_hw.comm_library import CheckedLibrary, CommLibrary, CommLibraryError
from tandem_hw.ctypes_library import bind_library
from tandem_hw.launch_turns import LaunchTurns

from tandem.collectives import ReduceOp
from tandem.device import Device, get_runtime

RunRanks = Callable[..., list[Any]]

HCCL_REDUCE = {
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.float32,
    torch.bfloat16,
}
HCCL_NO_PROD = {torch.int16, torch.bfloat16}
HCCL_MOVE = {
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.uint16,
    torch.int32,
    torch.uint32,
    torch.int64,
    torch.uint64,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.bfloat16,
}
NCCL_ALL = {
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.uint32,
    torch.int64,
    torch.uint64,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.bfloat16,
}

HCCL_STRINGS = {
    0: "no error",
    1: "parameter error",
    2: "empty pointer",
    3: "memory error",
    4: "internal error",
    5: "not support feature",
    6: "not found specific resource",
    7: "resource unavailable",
    8: "call system interface error",
    9: "timeout",
    10: "open file fail",
    11: "tcp connect fail",
    12: "roce connect fail",
    13: "tcp transfer fail",
    14: "roce transfer fail",
    15: "call runtime api fail",
    16: "call driver api fail",
    17: "call profiling api fail",
    18: "call cce api fail",
    19: "call network api fail",
    20: "try again",
    21: "error cqe",
    22: "unknow error",
    -1: "unknow error",
}
NCCL_STRINGS = {
    0: "no error",
    1: "unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
    2: "unhandled system error (run with NCCL_DEBUG=INFO for details)",
    3: "internal error - please report this issue to the NCCL developers",
    4: "invalid argument (run with NCCL_DEBUG=WARN for details)",
    5: "invalid usage (run with NCCL_DEBUG=WARN for details)",
    6: "remote process exited or there was a network error",
    7: "NCCL operation in progress",
    9: "unknown result code",
}


def _pair(library: CommLibrary, bind: DeviceBinder) -> list[CommGroup]:
    bind(Device("cpu", 0))
    comms = library.init_all([0, 1])
    devices = [Device("cpu", 0), Device("cpu", 1)]
    shared = Communicators(
        library, comms, devices, bind, LaunchTurns([str(d) for d in devices]), 60.0
    )
    return [
        CommGroup(library, c, r, 2, lambda: 1, shared, torch.device("cpu"))
        for r, c in enumerate(comms)
    ]


def checked(library: CommLibrary) -> CheckedLibrary:
    assert isinstance(library, CheckedLibrary)
    return library


def _values(dtype: torch.dtype, rank: int) -> torch.Tensor:
    return (torch.arange(6) % 4 + 1 + rank).to(dtype)


def _combine(dtype: torch.dtype, op: ReduceOp) -> torch.Tensor:
    """Rank 0's values with rank 1's, as torch computes them in ``dtype`` (integers through
    int64: torch has no maximum for every unsigned type, and the values are small)."""
    a, b = _values(dtype, 0), _values(dtype, 1)
    if not dtype.is_floating_point:
        a, b = a.to(torch.int64), b.to(torch.int64)
    combined = a + b if op is ReduceOp.SUM else torch.maximum(a, b)
    return combined.to(dtype)


def _outcome(fn: Callable[[], torch.Tensor]) -> torch.Tensor | str:
    try:
        return fn()
    except CommLibraryError as exc:
        return exc.library_message


def test_error_strings_are_the_libraries_own(library: CommLibrary) -> None:
    table = HCCL_STRINGS if library.name == "hccl" else NCCL_STRINGS
    assert {code: checked(library).error_string(code) for code in table} == table


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MAX])
def test_reductions_take_the_documented_types(
    library: CommLibrary, bind: DeviceBinder, run_ranks: RunRanks, op: ReduceOp
) -> None:
    groups = _pair(library, bind)
    supported = HCCL_REDUCE if library.name == "hccl" else NCCL_ALL
    for dtype in checked(library).data_types:

        def both(rank: int, dtype: torch.dtype = dtype) -> tuple[Any, Any]:
            group = groups[rank]
            return (
                _outcome(lambda: group.all_reduce(_values(dtype, rank), op)),
                _outcome(lambda: group.reduce_scatter(_values(dtype, rank), op)),
            )

        results = run_ranks(2, both)
        combined = _combine(dtype, op)
        for rank, (reduced, scattered) in enumerate(results):
            if dtype in supported:
                assert isinstance(reduced, torch.Tensor), (dtype, reduced)
                assert torch.equal(reduced, combined), dtype
                assert isinstance(scattered, torch.Tensor), (dtype, scattered)
                assert torch.equal(scattered, combined.chunk(2)[rank]), dtype
            else:
                assert library.name == "hccl"
                assert reduced == scattered == "not support feature", dtype
    groups[0]._communicators.close()


def test_hccl_prod_refuses_int16_and_bfloat16(standin_path: Path) -> None:
    """PROD is not an engine op, so the raw entry point: HCCL_REDUCE_PROD is 1."""
    library = hccl.HcclLibrary(standin_path)
    thread_binder(get_runtime("cpu"), library)(Device("cpu", 0))
    comm = library.init_all([0])[0]
    all_reduce = bind_library(standin_path, "hccl", hccl.FUNCTIONS)["HcclAllReduce"]
    for dtype in sorted(HCCL_REDUCE, key=str):
        buf = _values(dtype, 0)
        code = all_reduce(buf.data_ptr(), buf.data_ptr(), 6, hccl.DATA_TYPES[dtype], 1, comm, 1)
        assert code == (5 if dtype in HCCL_NO_PROD else 0), dtype
        if code == 0:
            assert torch.equal(buf, _values(dtype, 0)), dtype
    library.destroy(comm)


def test_data_movement_takes_the_documented_types(
    library: CommLibrary, bind: DeviceBinder, run_ranks: RunRanks
) -> None:
    groups = _pair(library, bind)
    supported = HCCL_MOVE if library.name == "hccl" else NCCL_ALL
    assert set(checked(library).data_types) == supported
    for dtype in sorted(supported, key=str):
        gathered = run_ranks(2, lambda r, d=dtype: groups[r].all_gather(_values(d, r)))
        sent = run_ranks(2, lambda r, d=dtype: groups[r].broadcast(_values(d, r), root=1))
        for rank in range(2):
            assert torch.equal(gathered[rank], torch.cat([_values(dtype, 0), _values(dtype, 1)]))
            assert torch.equal(sent[rank], _values(dtype, 1))
    groups[0]._communicators.close()


def test_half_precision_sums_round_like_torch(
    library: CommLibrary, bind: DeviceBinder, run_ranks: RunRanks
) -> None:
    """Subnormals, ties to even, overflow to infinity: each addition rounds as torch's does."""
    groups = _pair(library, bind)
    generator = torch.Generator().manual_seed(5)
    edges = torch.tensor([6e-8, 6.1e-5, 65504.0, 1.0, 2049.0, -0.0, 3.0e-5, 1e-3])
    for dtype in (torch.float16, torch.bfloat16):
        inputs = [
            torch.cat([edges, torch.randn(4096, generator=generator) * 10 ** (2 * r - 3)]).to(dtype)
            for r in range(2)
        ]
        inputs[1][:8] = torch.tensor([6e-8, 6.1e-5, 65504.0, 2**-11, 1.0, 0.0, 3.0e-5, 2.0]).to(
            dtype
        )
        out = run_ranks(2, lambda r, i=inputs: groups[r].all_reduce(i[r].clone()))
        expected = inputs[0].clone()
        expected += inputs[1]
        for result in out:
            assert torch.equal(result, expected), dtype
    groups[0]._communicators.close()
