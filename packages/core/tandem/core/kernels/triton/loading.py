"""Whether Triton serves a kernel on an accelerator, and the kernel where it does.

Triton is imported only here, and only when a CUDA or NPU device first resolves a kernel:
a CPU-only install never needs it. Where it is missing, or ``TANDEM_TRITON=0`` turns it off,
the torch references run, said once per process with what to install.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from tandem.core.kernels.handle import NativeChoice
from tandem.core.kernels.process_once import ProcessOnce

logger = logging.getLogger(__name__)

# The dtypes every Triton kernel here reads and writes (math in float32 inside).
TRITON_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})


def _usable(import_module: Callable[[str], object] = importlib.import_module) -> bool:
    if os.environ.get("TANDEM_TRITON", "1") == "0":
        logger.info("TANDEM_TRITON=0: accelerators run the torch reference kernels")
        return False
    try:
        import_module("triton")
    except ImportError:
        logger.warning(
            "Triton is not installed: CUDA and NPU devices run the torch reference kernels "
            "(slower). Install triton (CUDA) or triton-ascend matching CANN (NPU); see "
            "docs/ascend.md"
        )
        return False
    return True


triton_usable = ProcessOnce(_usable)


def triton_kernel(module: str, name: str) -> NativeChoice[Any]:
    """The Triton kernel ``name`` of ``kernels/triton/<module>.py`` for a dtype, where Triton
    is usable and the dtype is one the kernels handle."""

    def choose(dtype: torch.dtype) -> Callable[..., Any] | None:
        if dtype not in TRITON_DTYPES or not triton_usable():
            return None
        loaded = importlib.import_module(f"tandem.core.kernels.triton.{module}")
        fn: Callable[..., Any] = getattr(loaded, name)
        return fn

    return choose
