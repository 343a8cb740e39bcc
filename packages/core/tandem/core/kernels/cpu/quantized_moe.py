"""Routed experts with quantized weights on the CPU: the reference's grouped steps
(``reference/quantized_moe.py``) with each active expert's rows through the native dense
kernels, the int8 library (``int8_gemm.py``: VNNI, AVX2 or plain loops, over each expert's
weight packed once at load) and the 4-bit linear (``int4_linear.py``, reading the packed
codes). Each call is bit for bit the reference's for int8 (the library's steps are), and
forms each 4-bit weight as the reference does.

The experts' rows are sorted once per layer and their spans read on the host once, what the
float reference does too, and these steps make one kernel call per active expert and
projection. int8 experts packed at load skip them: one grouped call per projection serves
every expert (``NativeInt8.grouped_linear``, ``layers/quantized_moe.py``), except a
row-parallel down projection, which reduces between these steps. 4-bit experts whose groups
are consecutive inputs take the 4-bit library's grouped call the same way
(``NativeInt4Linear.grouped_linear``); experts in activation order (each its own ``g_idx``)
keep these steps, and the reference within them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from tandem.core.kernels.cpu.int4_linear import native_int4_linear
from tandem.core.kernels.cpu.int8_gemm import native_int8
from tandem.core.kernels.handle import NativeChoice
from tandem.core.kernels.reference import quantized_moe as grouped

# The grouped reference step each native step runs, by the int8 library's method it takes.
_INT8_STEPS: dict[str, Callable[..., Any]] = {
    "linear": grouped.grouped_int8_linear,
    "quantize": grouped.grouped_int8_quantize,
    "matmul": grouped.grouped_int8_matmul,
    "dequantize": grouped.grouped_int8_dequantize,
}


def native_moe_int8_kernel(step: str) -> NativeChoice[Any]:
    """The grouped int8 ``step`` over the native library's dense one, where it is built."""

    def choose(dtype: torch.dtype) -> Callable[..., Any] | None:
        kernels = native_int8()
        if kernels is None:
            return None
        return functools.partial(_INT8_STEPS[step], getattr(kernels, step))

    return choose


def native_moe_int4_kernel() -> NativeChoice[torch.Tensor]:
    """The grouped 4-bit linear over the native kernel, where it is built for the dtype (it
    keeps the reference itself for experts quantized in activation order)."""

    def choose(dtype: torch.dtype) -> Callable[..., torch.Tensor] | None:
        kernel = native_int4_linear()
        if kernel is None or not kernel.handles(dtype):
            return None
        return functools.partial(grouped.grouped_int4_linear, kernel.int4_linear)

    return choose


def native_moe_int4_grouped_kernel() -> NativeChoice[torch.Tensor]:
    """The 4-bit library's grouped linear over every expert in one call, where the library
    is built for the dtype and has it."""

    def choose(dtype: torch.dtype) -> Callable[..., torch.Tensor] | None:
        kernel = native_int4_linear()
        if kernel is None or not kernel.handles(dtype) or not kernel.grouped:
            return None
        return kernel.grouped_linear

    return choose
