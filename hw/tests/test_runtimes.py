"""The NPU and CUDA runtimes where no such device exists: found by kind through the entry
point, and failing with a message that says what to install instead of a traceback."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from tandem_hw.accelerator_runtime import parse_ascend_visible_devices, parse_visible_devices
from tandem_hw.cuda_runtime import CudaRuntime, CudaRuntimeUnavailable
from tandem_hw.npu_runtime import NpuRuntime, NpuRuntimeUnavailable, check_ascend_visible_devices

from tandem.device import get_runtime


def test_cuda_visible_devices_are_parsed_in_order() -> None:
    assert parse_visible_devices(None) is None
    assert parse_visible_devices(" ") is None
    assert parse_visible_devices("4,0, 7") == [4, 0, 7]
    with pytest.raises(ValueError, match="comma-separated integers"):
        parse_visible_devices("0,npu1")


@pytest.mark.parametrize(
    ("value", "ids", "read"),
    [
        ("1,2,3", [1, 2, 3], "1,2,3"),
        # CANN's own example: the space ends the list, so only device 1 is visible.
        ("1, 2,3", [1], "1,"),
        ("0,1,npu2", [0, 1], "0,1,"),
        ("4,", [4], "4,"),
        ("2,,3", [2], "2,,3"),
        (" 1", [], ""),
        # Not ascending: CANN supports ascending lists only, and exposes no device.
        ("3,1", [], "3,1"),
        ("1,1", [], "1,1"),
    ],
)
def test_ascend_visible_devices_are_read_as_cann_reads_them(
    value: str, ids: list[int], read: str
) -> None:
    visible = parse_ascend_visible_devices(value)
    assert visible is not None
    assert (visible.ids, visible.read) == (ids, read)
    assert parse_ascend_visible_devices(None) is None


def test_an_unordered_ascend_list_is_refused_with_the_fix(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(NpuRuntimeUnavailable, match="ascending order") as err:
        check_ascend_visible_devices("6,2,4")
    assert "write 2,4,6" in str(err.value)
    check_ascend_visible_devices("2,4,6")
    assert not caplog.records
    check_ascend_visible_devices("2, 4")
    assert "CANN reads only '2,'" in caplog.text and "devices [2]" in caplog.text


def test_npu_runtime_checks_the_visible_list_before_loading_torch_npu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "3,1")
    with pytest.raises(NpuRuntimeUnavailable, match="does not list its device ids in ascending"):
        NpuRuntime()


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu present")
def test_npu_runtime_without_torch_npu_says_what_to_install() -> None:
    with pytest.raises(NpuRuntimeUnavailable, match="torch_npu") as err:
        NpuRuntime()
    assert "docs/ascend.md" in str(err.value) and "--devices cpu:0" in str(err.value)
    # The engine finds the runtime by kind (entry point), and gets the same message.
    with pytest.raises(NpuRuntimeUnavailable, match="torch_npu"):
        get_runtime("npu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_runtime_without_a_gpu_says_so() -> None:
    with pytest.raises(CudaRuntimeUnavailable, match="sees no GPU"):
        CudaRuntime()
    with pytest.raises(CudaRuntimeUnavailable, match="sees no GPU"):
        get_runtime("cuda")
