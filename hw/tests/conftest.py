"""Fixtures for the hardware package's tests: the CPU stand-in library (built with the system C
compiler; the tests that need it skip with the reason where it cannot be built) and the
accelerator a device-marked test runs on (skipped with the reason where there is none)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from tandem_hw.comm_library import CommLibrary
from tandem_hw.hccl import HcclLibrary
from tandem_hw.nccl import NcclLibrary
from tandem_sim.standin_library import StandinUnavailable, build_standin_library


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
