"""The NPU and CUDA runtimes where no such device exists: found by kind through the entry
point, and failing with a message that says what to install instead of a traceback."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from tandem_hw.accelerator_runtime import parse_visible_devices
from tandem_hw.cuda_runtime import CudaRuntime, CudaRuntimeUnavailable
from tandem_hw.npu_runtime import NpuRuntime, NpuRuntimeUnavailable

from tandem.device import get_runtime


def test_visible_devices_are_parsed_in_order() -> None:
    assert parse_visible_devices(None) is None
    assert parse_visible_devices(" ") is None
    assert parse_visible_devices("4,0, 7") == [4, 0, 7]
    with pytest.raises(ValueError, match="comma-separated integers"):
        parse_visible_devices("0,npu1")


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
