"""Ascend NPUs through torch_npu (``torch.npu``)."""

from __future__ import annotations

import importlib
import os

from tandem_hw.accelerator_runtime import AcceleratorRuntime


class NpuRuntimeUnavailable(RuntimeError):
    pass


class NpuRuntime(AcceleratorRuntime):
    kind = "npu"
    stream_attr = "npu_stream"
    visible_env = "ASCEND_RT_VISIBLE_DEVICES"

    def __init__(self) -> None:
        try:
            # Importing torch_npu registers torch.npu and the "hccl" torch.distributed backend.
            importlib.import_module("torch_npu")
        except ImportError as exc:
            raise NpuRuntimeUnavailable(
                f"npu devices need torch_npu ({exc}); install CANN and the torch_npu build that "
                "matches torch 2.13.0 (see docs/ascend.md), or use --devices cpu:0"
            ) from None
        import torch

        module = torch.npu  # type: ignore[attr-defined]
        if not module.is_available():
            raise NpuRuntimeUnavailable(
                "torch_npu sees no NPU: check npu-smi info, the driver, and "
                "ASCEND_RT_VISIBLE_DEVICES"
            )
        super().__init__(module, dict(os.environ))
