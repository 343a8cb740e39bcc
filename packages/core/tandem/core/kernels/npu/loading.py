"""Whether torch_npu's fused ops serve a kernel, and the kernel where they do.

torch_npu is imported only here and in the modules this loads, only when an NPU device first
resolves a kernel (the NPU runtime imported it already to reach its devices).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Collection
from typing import Any

import torch

from tandem.core.kernels.handle import NativeChoice
from tandem.core.kernels.process_once import ProcessOnce

logger = logging.getLogger(__name__)

FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32})
# The attention ops and the cache write take half precision only (their pages' dtype tables).
HALVES = frozenset({torch.float16, torch.bfloat16})
# Kernels resolved by int8 codes (the quantized matmul's first operand).
INT8 = frozenset({torch.int8})


def _warn_missing() -> bool:
    logger.warning(
        "torch_npu does not import: NPU devices run the Triton kernels or the torch "
        "references instead of its fused ops; install the torch_npu build matching torch "
        "2.13.0 and CANN (docs/ascend.md)"
    )
    return True


_warned = ProcessOnce(_warn_missing)


def torch_npu_usable(import_module: Callable[[str], object] = importlib.import_module) -> bool:
    """Whether torch_npu imports now. Not kept: a runtime that lists this family has
    imported it already (the NPU runtime, or the simulator's with its stand-in in place), so
    asking again costs a dictionary lookup; said once where it does not import."""
    try:
        import_module("torch_npu")
    except ImportError:
        _warned()
        return False
    return True


def torch_npu_kernel(
    module: str, name: str, dtypes: Collection[torch.dtype] = FLOATS
) -> NativeChoice[Any]:
    """The kernel ``name`` of ``kernels/npu/<module>.py`` for a dtype its ops take."""

    def choose(dtype: torch.dtype) -> Callable[..., Any] | None:
        if dtype not in dtypes or not torch_npu_usable():
            return None
        loaded = importlib.import_module(f"tandem.core.kernels.npu.{module}")
        fn: Callable[..., Any] = getattr(loaded, name)
        return fn

    return choose
