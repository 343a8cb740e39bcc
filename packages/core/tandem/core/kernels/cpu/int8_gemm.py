"""The int8 linear (W8A8) on CPU (``csrc/int8_linear.cpp``): activations quantized per token
or with a static scale, an exact int32 product with weights packed once at load, and the
dequantize; fused into one pass for a layer's forward, or as the separate steps row-parallel
ranks need (they sum their int32 products between the product and the dequantize); and
for routed experts, every expert's rows through its own weight in one grouped call.

Every step gives what the torch reference (``reference/int8_linear.py``) gives, bit for bit
(int32 sums exact; the same float32 operations in the same order), so greedy tokens never
depend on which kernel ran. Code paths: AMX-INT8 (``tdpbssd`` on tiles) where the CPU has it
and Linux grants the tile state, AVX512-VNNI (``vpdpbusd`` on zmm) where the CPU has it,
AVX-VNNI (``vpdpbusd`` on ymm: AVX2-class CPUs that have it, or an AVX-512 CPU capped
at ``TANDEM_CPU_ISA=avx2`` that has it), AVX2 (exact int16 ``vpmaddwd``), plain loops
elsewhere; ``TANDEM_CPU_ISA`` caps them as for the other kernels, ``TANDEM_INT8=torch``
keeps the reference (said once in the log). The AMX path has a test build whose tile
instructions are software following Intel's documented semantics (``AMX_EMULATION_DEFINE``,
``csrc/amx_tiles.h``), so every CPU runs and checks that path's code; no AMX machine has
timed it yet.

Steps that receive a plain int8 weight (a layer nobody packed) run the reference, so the
handles may pick this kernel for any CPU layer.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from tandem.core.kernels.cpu.elementwise import FLAGS as ELEMENTWISE_FLAGS
from tandem.core.kernels.cpu.native_build import (
    CSRC,
    IsaLevel,
    KernelBuildError,
    amx_tiles_granted,
    build_library,
    log_unbuilt,
    selected_isa,
)
from tandem.core.kernels.handle import NativeChoice
from tandem.core.kernels.process_once import ProcessOnce
from tandem.core.kernels.reference import int8_linear as ref

logger = logging.getLogger(__name__)

SOURCE = CSRC / "int8_linear.cpp"
# The elementwise kernels' flags: without FMA contraction the dequantize rounds its product
# and its bias sum separately, as the reference's tensor ops do.
FLAGS = ELEMENTWISE_FLAGS
# The packed layout's group of consecutive k (one 32-bit lane of vpdpbusd); its panel of
# output columns is the library's (64; 16 on the AVX2 and AVX-VNNI paths, 32 on AMX), and so
# is the multiple its K is padded to (a group; 64 on AMX, an A tile's row); see the source.
GROUP = 4
PATHS = {4: "AMX-INT8", 3: "AVX-VNNI", 2: "AVX512-VNNI", 1: "AVX2", 0: "plain loops"}
# The define that builds the AMX-INT8 path (chosen by ``load_native_int8`` where it can run;
# native_build.AMX_EMULATION_DEFINE builds it on emulated tiles, for tests on any CPU).
AMX_DEFINE = "TANDEM_INT8_AMX"
_AMX_FLAGS = frozenset({"amx_tile", "amx_int8"})
# The define that builds the AVX-VNNI path with AVX512-VNNI's EVEX encoding of the same ymm
# instruction (AVX512-VL), for testing that path on CPUs without AVX-VNNI; see the source.
YMM_VNNI_TEST_DEFINE = "TANDEM_INT8_YMM_VNNI"
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_vp, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


@dataclass(frozen=True)
class PackedInt8Weight:
    """An int8 weight [out_features, in_features] in the kernel's layout
    [Np/P][Kp/4][P][4] (P = ``panel``; zero padded), with ``compensation`` [Np] int32 =
    128 * each column's sum (the VNNI paths take activations as q + 128)."""

    packed: torch.Tensor
    compensation: torch.Tensor
    out_features: int
    in_features: int

    @property
    def panel(self) -> int:
        return int(self.packed.shape[2])

    @property
    def padded_in(self) -> int:
        return int(self.packed.shape[1]) * GROUP

    @property
    def nbytes(self) -> int:
        """Memory it holds (the codes and the compensation)."""
        return self.packed.nbytes + self.compensation.nbytes


@dataclass(frozen=True)
class PackedInt8Experts:
    """Every routed expert's int8 weight [E, N, K], each in the kernel's layout, back to
    back ([E][Np/P][Kp/4][P][4], ``compensation`` [E][Np]), so one grouped call reads them
    all; ``expert(e)`` is expert e's as a dense weight (a view, no copy)."""

    packed: torch.Tensor
    compensation: torch.Tensor
    out_features: int
    in_features: int

    @property
    def experts(self) -> int:
        return int(self.packed.shape[0])

    @property
    def panel(self) -> int:
        return int(self.packed.shape[3])

    @property
    def padded_in(self) -> int:
        return int(self.packed.shape[2]) * GROUP

    @property
    def nbytes(self) -> int:
        """Memory it holds (the codes and the compensation)."""
        return self.packed.nbytes + self.compensation.nbytes

    def expert(self, e: int) -> PackedInt8Weight:
        return PackedInt8Weight(
            self.packed[e], self.compensation[e], self.out_features, self.in_features
        )


# Either packed form: ``_readable`` checks the panel width both carry.
Packed = TypeVar("Packed", PackedInt8Weight, PackedInt8Experts)


def pack_int8_experts(weight: torch.Tensor, panel: int, k_align: int = GROUP) -> PackedInt8Experts:
    """``weight`` int8 [E, N, K] in the layout with ``panel`` columns a panel and K padded to
    a multiple of ``k_align``, expert after expert (once per layer, at load)."""
    e, n, k = weight.shape
    np_, kp = -(-n // panel) * panel, -(-k // k_align) * k_align
    w = torch.nn.functional.pad(weight.detach(), (0, kp - k, 0, np_ - n))
    packed = w.view(e, np_ // panel, panel, kp // GROUP, GROUP).permute(0, 1, 3, 2, 4)
    compensation = (w.sum(dim=2, dtype=torch.int32) * 128).contiguous()
    return PackedInt8Experts(packed.contiguous(), compensation, n, k)


def pack_int8_weight(weight: torch.Tensor, panel: int, k_align: int = GROUP) -> PackedInt8Weight:
    """``weight`` int8 [N, K] in the layout with ``panel`` columns a panel and K padded to a
    multiple of ``k_align`` (once per layer, at load)."""
    return pack_int8_experts(weight.unsqueeze(0), panel, k_align).expert(0)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as [rows, last] with contiguous rows."""
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class NativeInt8:
    """The library's four steps, each with its torch reference's signature."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        self.path = path
        self.compiled_path = PATHS[int(lib.tandem_int8_path())]
        self.panel = int(lib.tandem_int8_panel())
        self.k_align = int(lib.tandem_int8_k_align())
        self.emulated = int(lib.tandem_amx_emulated()) == 1
        self._matmul = lib.tandem_int8_matmul
        self._matmul.argtypes = [_vp] * 4 + [_i64] * 6 + [_i32]
        self._linear = lib.tandem_int8_linear
        self._linear.argtypes = [_vp] * 7 + [_i64] * 6 + [_i32, _i32]
        self._quantize = lib.tandem_int8_quantize
        self._quantize.argtypes = [_vp] * 5 + [_i64] * 3 + [_i32, _i32]
        self._dequantize = lib.tandem_int8_dequantize
        self._dequantize.argtypes = [_vp] * 3 + [_i64] + [_vp] * 2 + [_i64] * 4 + [_i32, _i32]
        self._grouped = lib.tandem_int8_grouped_linear
        self._grouped.argtypes = [_vp] * 7 + [_i64] * 7 + [_i32, _i32]
        functions = (self._matmul, self._linear, self._quantize, self._dequantize, self._grouped)
        for function in functions:
            function.restype = ctypes.c_int

    @property
    def name(self) -> str:
        return f"int8 {self.compiled_path}{' (emulated tiles)' if self.emulated else ''}"

    def pack(self, weight: torch.Tensor) -> PackedInt8Weight:
        """``weight`` int8 [N, K] in the layout this build reads."""
        return pack_int8_weight(weight, self.panel, self.k_align)

    def pack_experts(self, weight: torch.Tensor) -> PackedInt8Experts:
        """``weight`` int8 [E, N, K] in the layout this build reads, expert after expert."""
        return pack_int8_experts(weight, self.panel, self.k_align)

    def _readable(self, weight: Packed) -> Packed:
        # A layout of another panel width pairs the wrong columns: refused, not misread.
        if weight.panel != self.panel:
            raise ValueError(
                f"a weight packed in panels of {weight.panel} columns; this {self.name} "
                f"kernel reads panels of {self.panel}"
            )
        if weight.padded_in % self.k_align:
            raise ValueError(
                f"a weight packed with K padded to {weight.padded_in}; this {self.name} "
                f"kernel reads K padded to a multiple of {self.k_align}"
            )
        return weight

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != 0:
            raise ValueError(f"the native int8 {what} kernel refused its arguments (code {code})")

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | PackedInt8Weight,
        weight_scale: torch.Tensor,
        input_scale: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """The reference's ``int8_linear`` in one pass over a packed weight."""
        if not isinstance(weight, PackedInt8Weight):
            return ref.int8_linear(x, weight, weight_scale, input_scale, bias)
        weight = self._readable(weight)
        # Other float dtypes go through float32: exact, as the reference's own math is.
        dtype = x.dtype if x.dtype in _DTYPES else torch.float32
        rows = _rows(x.to(dtype))
        out = torch.empty(rows.shape[0], weight.out_features, dtype=dtype)
        # Bound to names: a temporary's memory is freed once its pointer is read.
        ws = weight_scale.float().reshape(-1).contiguous()
        b = bias.float().contiguous() if bias is not None else None
        fixed = input_scale.float().reshape(1).contiguous() if input_scale is not None else None
        code = self._linear(
            out.data_ptr(), rows.data_ptr(), weight.packed.data_ptr(),
            weight.compensation.data_ptr(), ws.data_ptr(), _ptr(b), _ptr(fixed), rows.shape[0],
            weight.out_features, weight.in_features, weight.padded_in, rows.stride(0),
            out.stride(0), _DTYPES[dtype], torch.get_num_threads(),
        )  # fmt: skip
        self._check(code, "linear")
        return out.to(x.dtype).view(*x.shape[:-1], weight.out_features)

    def grouped_linear(
        self,
        x: torch.Tensor,
        experts: PackedInt8Experts,
        offsets: torch.Tensor,
        weight_scales: torch.Tensor,
        input_scales: torch.Tensor | None,
    ) -> torch.Tensor:
        """Rows ``offsets[e]`` to ``offsets[e + 1]`` of ``x`` [M, K] (sorted by expert)
        through expert e's int8 weight, every expert in one call -> [M, N]: each row what
        ``linear`` gives for it with its expert's weight, ``weight_scales`` [E, N, 1] and
        static scale ``input_scales`` [E] (None: per token). ``offsets`` [E + 1] int64 is
        read where it lies (no host sync); offsets out of order or not ending at M are
        refused."""
        experts = self._readable(experts)
        e, n = experts.experts, experts.out_features
        if offsets.dtype is not torch.int64 or offsets.shape != (e + 1,):
            raise ValueError(f"offsets must be int64 [{e + 1}]")
        if weight_scales.shape[:2] != (e, n):
            raise ValueError(f"weight scales must be [{e}, {n}, 1]")
        dtype = x.dtype if x.dtype in _DTYPES else torch.float32
        rows = _rows(x.to(dtype))
        if rows.shape[1] != experts.in_features:
            raise ValueError(f"rows of {rows.shape[1]} inputs for experts of {experts.in_features}")
        out = torch.empty(rows.shape[0], n, dtype=dtype)
        # Bound to names: a temporary's memory is freed once its pointer is read.
        ws = weight_scales.float().reshape(e, n).contiguous()
        fixed = input_scales.float().reshape(e).contiguous() if input_scales is not None else None
        bounds = offsets.contiguous()
        code = self._grouped(
            out.data_ptr(), rows.data_ptr(), experts.packed.data_ptr(),
            experts.compensation.data_ptr(), ws.data_ptr(), _ptr(fixed), bounds.data_ptr(), e,
            rows.shape[0], n, experts.in_features, experts.padded_in,
            rows.stride(0), out.stride(0), _DTYPES[dtype], torch.get_num_threads(),
        )  # fmt: skip
        self._check(code, "grouped linear")
        return out.to(x.dtype)

    def matmul(self, a: torch.Tensor, b: torch.Tensor | PackedInt8Weight) -> torch.Tensor:
        """int8 codes [M, K] times a packed weight: exact int32 [M, N]."""
        if not isinstance(b, PackedInt8Weight):
            return ref.int8_matmul(a, b)
        b = self._readable(b)
        rows = _rows(a)
        out = torch.empty(rows.shape[0], b.out_features, dtype=torch.int32)
        code = self._matmul(
            out.data_ptr(), rows.data_ptr(), b.packed.data_ptr(), b.compensation.data_ptr(),
            rows.shape[0], b.out_features, b.in_features, b.padded_in, rows.stride(0),
            out.stride(0), torch.get_num_threads(),
        )  # fmt: skip
        self._check(code, "matmul")
        return out

    def quantize(
        self, x: torch.Tensor, scale: torch.Tensor | None, absmax: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's ``quantize_int8``."""
        dtype = x.dtype if x.dtype in _DTYPES else torch.float32
        rows = _rows(x.to(dtype))
        m = rows.shape[0]
        q = torch.empty(rows.shape, dtype=torch.int8)
        fixed = scale.float().reshape(1).contiguous() if scale is not None else None
        peak = absmax.float().reshape(-1).contiguous() if absmax is not None else None
        out_scale = torch.empty((1, 1) if fixed is not None else (m, 1), dtype=torch.float32)
        code = self._quantize(
            q.data_ptr(), out_scale.data_ptr(), rows.data_ptr(), _ptr(peak), _ptr(fixed), m,
            rows.shape[1], rows.stride(0), _DTYPES[dtype], torch.get_num_threads(),
        )  # fmt: skip
        self._check(code, "quantize")
        return q, out_scale

    def dequantize(
        self,
        acc: torch.Tensor,
        scale: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """The reference's ``dequantize``."""
        kind = dtype if dtype in _DTYPES else torch.float32
        sums = _rows(acc)
        m, n = sums.shape
        out = torch.empty(m, n, dtype=kind)
        s = scale.float().reshape(-1).contiguous()
        ws = weight_scale.float().reshape(-1).contiguous()
        b = bias.float().contiguous() if bias is not None else None
        code = self._dequantize(
            out.data_ptr(), sums.data_ptr(), s.data_ptr(), 0 if s.numel() == 1 else 1,
            ws.data_ptr(), _ptr(b), m, n, sums.stride(0), out.stride(0), _DTYPES[kind],
            torch.get_num_threads(),
        )  # fmt: skip
        self._check(code, "dequantize")
        return out.to(dtype)


def load_native_int8(
    build_dir: Path | None = None,
    isa: IsaLevel | None = None,
    defines: Sequence[str] = (),
    amx: bool = True,
) -> NativeInt8 | None:
    """Build (if needed) and load the kernels (for the instruction sets ``isa`` allows,
    default ``TANDEM_CPU_ISA``'s; ``defines``: preprocessor names of a variant, such as
    ``YMM_VNNI_TEST_DEFINE``, which the build's name then tells apart); None, with the reason
    logged, where they cannot be had. Without ``defines``, the AMX-INT8 path where the CPU
    has it and Linux grants the tile state (``amx``: whether to look), else the best other."""
    if os.environ.get("TANDEM_INT8", "").lower() == "torch":
        logger.info("TANDEM_INT8=torch: int8 (W8A8) layers run the torch reference")
        return None
    if amx and not defines:
        on_tiles = _load_amx(build_dir, isa)
        if on_tiles is not None:
            return on_tiles
    flags = (*FLAGS, *(f"-D{name}" for name in defines))
    try:
        return NativeInt8(build_library(SOURCE, "tandem_int8_linear", flags, build_dir, isa))
    except (KernelBuildError, OSError) as exc:
        log_unbuilt(logger, exc, "no CPU int8 kernels (%s); W8A8 layers run torch", exc)
        return None


def _load_amx(build_dir: Path | None, isa: IsaLevel | None) -> NativeInt8 | None:
    """The AMX-INT8 build, or None (the reason logged where the CPU has AMX-INT8)."""
    try:
        level = isa or selected_isa()
    except KernelBuildError:
        return None  # the plain build reports the bad level
    if not level.cpu_flags() >= _AMX_FLAGS:
        return None
    if not amx_tiles_granted():
        logger.warning(
            "the CPU has AMX-INT8 but Linux did not grant this process the tile state "
            "(arch_prctl ARCH_REQ_XCOMP_PERM); int8 layers use the vector path"
        )
        return None
    flags = (*FLAGS, f"-D{AMX_DEFINE}")
    try:
        return NativeInt8(build_library(SOURCE, "tandem_int8_linear", flags, build_dir, isa))
    except (KernelBuildError, OSError) as exc:
        log_unbuilt(logger, exc, "no AMX-INT8 build (%s); int8 layers use the vector path", exc)
        return None


# The process's kernels, built and loaded on first use.
native_int8 = ProcessOnce(load_native_int8)


def native_int8_kernel(name: str) -> NativeChoice[Any]:
    """The step ``name`` of this library (for every dtype: others pass through float32),
    where it is built."""

    def choose(dtype: torch.dtype) -> Callable[..., Any] | None:
        kernels = native_int8()
        if kernels is None:
            return None
        fn: Callable[..., Any] = getattr(kernels, name)
        return fn

    return choose
