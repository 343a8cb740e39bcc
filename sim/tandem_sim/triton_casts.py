"""Triton's interpreter rounding float32 -> bfloat16 as compiled Triton does.

A kernel's ``x.to(tl.bfloat16)`` compiles to LLVM's ``fptrunc`` (``cvt.rn.bf16.f32`` on CUDA),
which rounds to nearest, ties to even, as torch's ``.to(torch.bfloat16)`` and every C++
kernel here do. Triton's interpreter (``triton/runtime/interpreter.py``, ``_convert_float``)
keeps the top 16 bits instead, unless the kernel names ``fp_downcast_rounding="rtne"``, and
even then it rounds ties away from zero. So a bfloat16 kernel run by the interpreter drifts
from the device it stands in for by a unit in the last place per rounding, and greedy tokens
compared across kernel families flip on random demo models.

The stand-in NPU runs the Triton kernels as a device would; ``round_like_compiled_triton``
swaps that one conversion for round-to-nearest-even and leaves every other one (and an
explicit ``fp_downcast_rounding="rtz"``) to the interpreter.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


def float32_bits_to_bfloat16(bits: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """float32 bit patterns (uint32) -> bfloat16 bit patterns (uint16), ties to even; NaN
    stays a quiet NaN of its sign."""
    wide = bits.astype(np.uint64)
    rounded = ((wide + 0x7FFF + ((wide >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    quiet = ((bits >> 16) | 0x0040).astype(np.uint16)
    return np.where(nan, quiet, rounded)


def round_like_compiled_triton() -> None:
    """Make the interpreter's float32 -> bfloat16 casts round to nearest even, once per
    process (the interpreter module is process-wide)."""
    from triton._C.libtriton import ir
    from triton.language import core as tl
    from triton.runtime import interpreter

    convert = interpreter._convert_float
    if getattr(convert, "rounds_like_compiled_triton", False):
        return

    def rounded(
        input: np.ndarray[Any, Any], input_dtype: Any, output_dtype: Any, rounding_mode: Any
    ) -> np.ndarray[Any, Any]:
        if (
            input_dtype == tl.float32
            and output_dtype == tl.bfloat16
            and rounding_mode != ir.ROUNDING_MODE.RTZ
        ):
            bits = np.frombuffer(input.tobytes(), dtype=np.uint32)
            return float32_bits_to_bfloat16(bits).reshape(input.shape)
        kept: np.ndarray[Any, Any] = convert(input, input_dtype, output_dtype, rounding_mode)
        return kept

    rounded.rounds_like_compiled_triton = True  # type: ignore[attr-defined]
    interpreter._convert_float = rounded
    logger.info("triton's interpreter: float32 -> bfloat16 rounds to nearest even, as compiled")
