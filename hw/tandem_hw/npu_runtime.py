"""Ascend NPUs through torch_npu (``torch.npu``)."""

from __future__ import annotations

import importlib
import logging
import os

from tandem_hw.accelerator_runtime import AcceleratorRuntime, parse_ascend_visible_devices

logger = logging.getLogger(__name__)

VISIBLE_ENV = "ASCEND_RT_VISIBLE_DEVICES"


class NpuRuntimeUnavailable(RuntimeError):
    pass


def check_ascend_visible_devices(value: str | None) -> None:
    """Refuse a list CANN would turn into no devices; warn where it reads less than written."""
    visible = parse_ascend_visible_devices(value)
    if visible is None:
        return
    if not visible.ascending:
        raise NpuRuntimeUnavailable(
            f"{VISIBLE_ENV}={value} does not list its device ids in ascending order; CANN "
            "supports ascending lists only and exposes no device otherwise: write "
            f"{','.join(str(i) for i in sorted(set(visible.listed)))} and name --devices by "
            "position in that list"
        )
    if visible.read != value:
        logger.warning(
            "%s=%s: CANN reads only %r (it stops at the first character that is not a digit "
            "or a comma), so this process sees devices %s",
            VISIBLE_ENV,
            value,
            visible.read,
            visible.ids,
        )


class NpuRuntime(AcceleratorRuntime):
    kind = "npu"
    # torch_npu's fused ops where it has one (attention, norms, rotary, SwiGLU, MoE), as
    # vllm-ascend; Triton (triton-ascend) for the rest (Gated DeltaNet, gated norms).
    kernel_families: tuple[str, ...] = ("torch_npu", "triton")
    stream_attr = "npu_stream"
    visible_env = VISIBLE_ENV

    def __init__(self) -> None:
        check_ascend_visible_devices(os.environ.get(VISIBLE_ENV))
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
                f"{VISIBLE_ENV} (ascending ids only)"
            )
        super().__init__(module, dict(os.environ))

    def visible_ids(self, value: str | None) -> list[int] | None:
        visible = parse_ascend_visible_devices(value)
        return None if visible is None else visible.ids
