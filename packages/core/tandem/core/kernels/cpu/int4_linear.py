"""The 4-bit weight-only linear (W4A16: GPTQ and AWQ) on the CPU (``csrc/int4_linear.cpp``),
reading the packed codes the layer keeps, in place of the torch reference, which turns the
whole weight into floats on every call.

Batches up to ``DECODE_ROWS`` rows (decode, and small mixed steps) run the fused kernel: the
weight is read as the packed codes, a quarter of bfloat16's bytes, and turned into floats in
registers (or in an L1 buffer) four output rows at a time (the source says how). bfloat16
activations on a CPU with AVX512-BF16 run the kernel's dot-product path instead, up to
``BF16_DOT_ROWS`` rows: bfloat16 weights formed once per call and VDPBF16PS, twice the
float32 FMAs' products an instruction, which keeps up with torch's bfloat16 GEMM on the
dense weight at batches where the float32 path fell behind it (figures in the source).
Larger batches (prefill) have the C++ dequantize the whole weight in a pass and torch's GEMM
take it: the pass is cheap beside a product of that many rows, and the GEMM library is as
fast there as the kernel, or faster.

Every path forms each weight exactly as the reference does, ``(q - z) * s`` in float32 and
rounded to bfloat16 for bfloat16 activations; the kernel sums in float32 in its own order.
The kernel reads groups of consecutive inputs only: a layer quantized in activation order
reaches it with its inputs sorted by group at load (``layers/int4_weights.py``), and one whose
groups cannot be sorted so (a tensor-parallel rank's uneven share) keeps ``g_idx`` and the
reference. Built for AVX-512 (with or without AVX512-BF16), AVX2 or plain
loops by ``TANDEM_CPU_ISA`` (``native_build``); ``TANDEM_INT4=torch`` keeps the reference.

Routed experts take ``grouped_linear`` (``csrc/int4_grouped.h``): every expert's rows in one
call, the routing's offsets read by the kernel, each expert's rows through the same tiles and
panels a dense call on them runs; batches averaging more than ``kernel_rows`` rows an expert
(prefill) take the dense calls expert by expert instead, for their dequantize-then-GEMM.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem.core.kernels.cpu.native_build import (
    BASE_FLAGS,
    CSRC,
    IsaLevel,
    KernelBuildError,
    build_library,
    c_function,
    compiled_path,
    log_unbuilt,
)
from tandem.core.kernels.handle import NativeChoice
from tandem.core.kernels.process_once import ProcessOnce
from tandem.core.kernels.reference import int4_linear as reference
from tandem.core.kernels.reference.quantized_moe import grouped_reference

logger = logging.getLogger(__name__)

SOURCE = CSRC / "int4_linear.cpp"
# Up to this many activation rows the fused kernel; above, dequantize and GEMM.
DECODE_ROWS = 32
# The same for bfloat16 activations where the kernel takes AVX512-BF16 dot products: level
# with dequantize-then-GEMM from about here (``csrc/int4_linear.cpp`` has the figures).
BF16_DOT_ROWS = 128
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_vp, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


class NativeInt4Linear:
    """The kernel library, with the reference's ``int4_linear`` signature."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        # avx512, avx2 or portable: the code path this build runs.
        self.compiled_path = compiled_path(lib)
        self._linear = c_function(lib.tandem_int4_linear, [_vp] * 6 + [_i64] * 6 + [_i32, _i32])
        self._dequantize = c_function(
            lib.tandem_int4_dequantize, [_vp] * 4 + [_i64] * 3 + [_i32, _i32]
        )
        # The routed experts' grouped linear (``csrc/int4_grouped.h``); None in a library
        # built from an older source (a benchmark's baseline).
        self._grouped = (
            c_function(lib.tandem_int4_grouped_linear, [_vp] * 6 + [_i64] * 7 + [_i32, _i32])
            if hasattr(lib, "tandem_int4_grouped_linear")
            else None
        )
        # Whether bfloat16 activations take AVX512-BF16 dot products (a library built from an
        # older source, as a benchmark's baseline, has no such path and no flag).
        self.bf16_dot = hasattr(lib, "tandem_int4_bf16_dot") and bool(
            c_function(lib.tandem_int4_bf16_dot, [])()
        )
        # The most activation rows a call runs the kernel on, by dtype; above, the weight is
        # dequantized whole for torch's GEMM.
        self.kernel_rows = {
            torch.float32: DECODE_ROWS,
            torch.bfloat16: BF16_DOT_ROWS if self.bf16_dot else DECODE_ROWS,
        }

    def describe(self) -> str:
        """What runs, by dtype and batch size (for the start-up report)."""
        fused = f"fused up to {DECODE_ROWS} rows"
        if not self.bf16_dot:
            return f"{fused}, dequantized then torch's GEMM above"
        return (
            f"float32 {fused}, bfloat16 AVX512-BF16 dot products on bfloat16 weight panels "
            f"up to {self.kernel_rows[torch.bfloat16]} rows; dequantized then torch's GEMM above"
        )

    @staticmethod
    def handles(dtype: torch.dtype) -> bool:
        return dtype in _DTYPES

    @staticmethod
    def reads(codes: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None) -> bool:
        """Whether the kernel reads this layer: groups of consecutive inputs, each a whole
        number of packed words."""
        inputs = codes.shape[1] * 8
        groups = scales.shape[1]
        return g_idx is None and groups > 0 and inputs % groups == 0 and (inputs // groups) % 8 == 0

    def int4_linear(
        self,
        x: torch.Tensor,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        g_idx: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        if x.dtype not in _DTYPES or not self.reads(codes, scales, g_idx):
            return reference.int4_linear(x, codes, scales, zeros, g_idx, bias)
        rows_out, words = codes.shape
        inputs = words * 8
        rows = x.reshape(-1, inputs)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        # Bound to names: a temporary's memory is freed as soon as its pointer is read.
        codes_c = codes.contiguous()
        # The reference rounds the scales to the activations' dtype first; so must we.
        scales_c = scales.to(x.dtype).contiguous()
        zeros_c = zeros.to(torch.uint8).contiguous()
        dtype, threads = _DTYPES[x.dtype], torch.get_num_threads()
        if rows.shape[0] > self.kernel_rows[x.dtype]:
            weight = torch.empty(rows_out, inputs, dtype=x.dtype)
            code = self._dequantize(
                weight.data_ptr(), codes_c.data_ptr(), scales_c.data_ptr(), zeros_c.data_ptr(),
                rows_out, inputs, scales_c.shape[1], dtype, threads,
            )  # fmt: skip
            self._check(code)
            return F.linear(x, weight, bias)
        bias_c = bias.to(x.dtype).contiguous() if bias is not None else None
        out = torch.empty(rows.shape[0], rows_out, dtype=x.dtype)
        code = self._linear(
            out.data_ptr(), rows.data_ptr(), codes_c.data_ptr(), scales_c.data_ptr(),
            zeros_c.data_ptr(), bias_c.data_ptr() if bias_c is not None else None,
            rows.shape[0], rows_out, inputs, scales_c.shape[1], rows.stride(0), out.stride(0),
            dtype, threads,
        )  # fmt: skip
        self._check(code)
        return out.view(*x.shape[:-1], rows_out)

    @property
    def grouped(self) -> bool:
        """Whether this library has the experts' grouped linear."""
        return self._grouped is not None

    def grouped_linear(
        self,
        rows: torch.Tensor,
        offsets: torch.Tensor,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
    ) -> torch.Tensor:
        """Rows ``offsets[e]`` to ``offsets[e + 1]`` of ``rows`` [M, K] (sorted by expert)
        times expert ``e``'s weight (``codes`` [E, N, K / 8], ``scales`` and ``zeros``
        [E, N, G], each expert's as ``int4_linear`` takes them), every expert in one call ->
        [M, N] in ``rows``' dtype. The offsets ([E + 1] int64) are read by the kernel where
        they lie (no host sync); it refuses ones out of order or not spanning the M rows.
        Experts the kernel does not read (groups not whole packed words), and batches of
        more than ``kernel_rows`` rows an expert on average, run the per-expert path instead,
        which reads the offsets on the host."""
        experts, n, words = codes.shape
        if (
            self._grouped is None
            or rows.dtype not in _DTYPES
            or not self.reads(codes[0], scales[0], None)
            or rows.shape[0] > experts * self.kernel_rows[rows.dtype]
        ):
            # Past kernel_rows rows an expert on average (prefill, never a decode step's
            # batch), the per-expert path's dequantize-then-GEMM is ahead of the kernel:
            # 3.2 against 5.0 ms for 512 rows of one expert, N = 1280, K = 512, bfloat16,
            # one thread (the dense call's kernel is as slow there).
            return grouped_reference(self.int4_linear, rows, offsets, codes, scales, zeros)
        if rows.dim() != 2 or rows.shape[1] != words * 8:
            raise ValueError(f"the grouped 4-bit linear takes rows of {words * 8} inputs")
        if offsets.dtype is not torch.int64 or offsets.shape != (experts + 1,):
            raise ValueError(f"expert offsets must be {experts + 1} int64 entries")
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        # Bound to names: a temporary's memory is freed as soon as its pointer is read.
        offsets_c = offsets.contiguous()
        codes_c = codes.contiguous()
        # The reference rounds the scales to the activations' dtype first; so must we (a
        # no-op for a model cast to its dtype at load, as the loader casts it).
        scales_c = scales.to(rows.dtype).contiguous()
        zeros_c = zeros.to(torch.uint8).contiguous()
        out = torch.empty(rows.shape[0], n, dtype=rows.dtype)
        code = self._grouped(
            out.data_ptr(), rows.data_ptr(), codes_c.data_ptr(), scales_c.data_ptr(),
            zeros_c.data_ptr(), offsets_c.data_ptr(), experts, rows.shape[0], n, words * 8,
            scales_c.shape[2], rows.stride(0), out.stride(0), _DTYPES[rows.dtype],
            torch.get_num_threads(),
        )  # fmt: skip
        self._check(code)
        return out

    @staticmethod
    def _check(code: int) -> None:
        if code != 0:
            raise ValueError(f"the native int4 linear kernel refused its arguments (code {code})")


def load_native_int4_linear(
    build_dir: Path | None = None, isa: IsaLevel | None = None
) -> NativeInt4Linear | None:
    """Build (if needed) and load the kernel (for the instruction sets ``isa`` allows, default
    ``TANDEM_CPU_ISA``'s); None, with the reason logged, where it cannot be had."""
    if os.environ.get("TANDEM_INT4", "").lower() == "torch":
        logger.info("TANDEM_INT4=torch: 4-bit linears run the torch reference")
        return None
    try:
        path = build_library(SOURCE, "tandem_int4_linear", BASE_FLAGS, build_dir, isa)
        return NativeInt4Linear(path)
    except (KernelBuildError, OSError) as exc:
        log_unbuilt(
            logger,
            exc,
            "no CPU 4-bit linear kernel (%s); W4A16 layers dequantize their whole weight "
            "every call (the torch reference)",
            exc,
        )
        return None


# The process's kernel, built and loaded on first use.
native_int4_linear = ProcessOnce(load_native_int4_linear)


def native_int4_kernel() -> NativeChoice[torch.Tensor]:
    """The CPU kernel for a dtype, where it is built (it falls back to the reference itself
    for the layers it does not read)."""

    def choose(dtype: torch.dtype) -> Callable[..., torch.Tensor] | None:
        kernel = native_int4_linear()
        if kernel is None or not kernel.handles(dtype):
            return None
        return kernel.int4_linear

    return choose
