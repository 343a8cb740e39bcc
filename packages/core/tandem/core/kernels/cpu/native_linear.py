"""Our own linear kernels that read the weights where oneDNN packed them: what they share.

oneDNN's kernels leave part of the memory bandwidth or of the FMA units unused on small
hosts: at decode batch sizes a step streams every weight once, and a kernel that computes
while the stream runs does better. Our kernels (``amx_linear`` for bfloat16 decode batches
on AMX CPUs, ``avx512_linear`` for float32, and bfloat16 without AMX, on AVX-512 CPUs) read
the weight where oneDNN packed it, so the model keeps one copy; batches of more than a
kernel's ``max_rows`` rows stay with oneDNN. oneDNN does not document its packed layouts,
so a kernel adopts a weight only after its product on a probe batch matched oneDNN's
(``PackedWeightKernel.adopt``).
"""

from __future__ import annotations

import ctypes
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.core.kernels.cpu.elementwise import FLAGS as ELEMENTWISE_FLAGS
from tandem.core.kernels.cpu.native_build import (
    IsaLevel,
    KernelBuildError,
    build_library,
    c_function,
    log_unbuilt,
    selected_isa,
)

logger = logging.getLogger(__name__)

_vp, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
# The widest output panel of any kernel here (AVX-512's 64 columns; AMX 32, AVX2 fewer): a
# weight padded by fewer rows than this reaches a width the kernel walks, if any does.
_WIDEST_PANEL = 64


# The elementwise kernels' flags (no FMA contraction, their vector width): the kernels' FMAs
# are intrinsics either way, and an activation fused into a GEMM's epilogue then rounds as
# the elementwise kernel it replaces.
LINEAR_FLAGS = ELEMENTWISE_FLAGS


def load_kernel_library(
    what: str,
    source: Path,
    required_flags: frozenset[str],
    build_dir: Path | None = None,
    isa: IsaLevel | None = None,
    defines: Sequence[str] = (),
) -> ctypes.CDLL | None:
    """Build (if needed) and load the library of a linear kernel; None where this CPU or
    process cannot have it, the reason logged. ``TANDEM_GEMM=onednn`` (the A side of an A/B)
    keeps oneDNN at every batch size. ``defines``: preprocessor names (a test build's, a CPU
    vendor's tuning), which the library's cache name tells apart."""
    if os.environ.get("TANDEM_GEMM", "").lower() == "onednn":
        logger.info("TANDEM_GEMM=onednn: no %s linear kernel, oneDNN at every batch size", what)
        return None
    isa = isa or selected_isa()
    missing = required_flags - isa.cpu_flags()
    if missing:
        logger.debug(
            "no %s linear kernel: the CPU (at ISA level %s) lacks %s",
            what,
            isa.name,
            " ".join(sorted(missing)),
        )
        return None
    flags = (*LINEAR_FLAGS, *(f"-D{name}" for name in defines))
    try:
        return ctypes.CDLL(
            str(build_library(source, f"tandem_{source.stem}", flags, build_dir, isa))
        )
    except (KernelBuildError, OSError) as exc:
        log_unbuilt(logger, exc, "no %s linear kernel (%s); its layers use oneDNN", what, exc)
        return None


@dataclass(frozen=True)
class AdoptedWeight:
    """A packed weight [out_features, in_features] ``kernel`` was checked on."""

    kernel: PackedWeightKernel
    packed: torch.Tensor
    out_features: int
    in_features: int
    # Where the packed bytes lie; they stay there (moving them onto huge pages keeps the
    # address), and asking oneDNN per call costs a dispatch per layer per step.
    address: int

    @property
    def max_rows(self) -> int:
        return self.kernel.max_rows

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [rows <= max_rows, in_features], rows contiguous -> [rows, out_features]."""
        return self.kernel.matmul(x, self)


class PackedWeightKernel(ABC):
    """A native kernel for ``x W^T`` with W in oneDNN's packed layout, at most ``max_rows``
    rows of x."""

    name: str
    dtype: torch.dtype
    max_rows: int
    # Rows of the probe batch (chosen to reach every code path of the kernel), and how far
    # its product may be from oneDNN's, relative to the outputs' largest magnitude.
    probe_rows: int
    tolerance: float
    # Columns of one panel of the layout the kernel walks.
    panel: int
    # What else the start-up report says of it (a choice made for this CPU), or nothing.
    detail: str = ""

    @abstractmethod
    def readable(self, out_features: int, in_features: int) -> bool:
        """Whether the kernel walks oneDNN's layout for this shape (no padding it skips)."""

    def readable_width(self, out_features: int, in_features: int) -> int | None:
        """The fewest outputs, ``out_features`` or more, of a weight the kernel walks at
        ``in_features`` (a layer may pad its weight with zero rows to it), or None."""
        for width in range(out_features, out_features + _WIDEST_PANEL):
            if self.readable(width, in_features):
                return width
        return None

    @abstractmethod
    def packed_bytes(self, out_features: int, in_features: int) -> int:
        """The size of oneDNN's buffer in the layout the kernel reads."""

    def bind(
        self,
        function: ctypes._NamedFuncPointer,
        limits: tuple[int, ...] = (),
        silu: ctypes._NamedFuncPointer | None = None,
    ) -> None:
        """Use ``function`` (out, x, w, M, N, K, ldx, ldo, *limits, num_threads) -> int, the
        C signature every kernel here exports; ``limits``: int32 bounds passed on each call;
        ``silu``: the same product with SiLU-and-mul as its epilogue, where the library has
        one (same signature, an output half as wide)."""
        function.argtypes = [_vp, _vp, _vp, *[_i64] * 5, *[_i32] * len(limits), _i32]
        function.restype = ctypes.c_int
        self._function = function
        self._limits = limits
        self._silu = None if silu is None else c_function(silu, list(function.argtypes))

    def _call(
        self,
        function: ctypes._NamedFuncPointer,
        out: torch.Tensor,
        x: torch.Tensor,
        weight: AdoptedWeight,
    ) -> int:
        return int(
            function(
                out.data_ptr(), x.data_ptr(), weight.address, x.shape[0],
                weight.out_features, weight.in_features, x.stride(0), out.stride(0),
                *self._limits, torch.get_num_threads(),
            )
        )  # fmt: skip

    def run(self, out: torch.Tensor, x: torch.Tensor, weight: AdoptedWeight) -> int:
        """Computes ``out = x W^T``; 0, or the kernel's code for arguments it refused."""
        return self._call(self._function, out, x, weight)

    def silu_matmul(self, x: torch.Tensor, weight: AdoptedWeight) -> torch.Tensor | None:
        """silu(x G^T) * (x U^T) for a weight W = [G; U] (a gate/up projection) -> [rows,
        out / 2] in one call, what ``silu_mul`` of the plain product gives, bit for bit;
        None where the kernel has no fused entry point or either half is off its panels
        (the caller multiplies, then activates). ``weight`` is one this kernel adopted."""
        if self._silu is None or weight.out_features % (2 * self.panel) != 0:
            return None
        out = torch.empty(x.shape[0], weight.out_features // 2, dtype=self.dtype)
        code = self._call(self._silu, out, x, weight)
        if code != 0:
            raise ValueError(f"the {self.name} SiLU linear kernel refused its arguments ({code})")
        return out

    def matmul(self, x: torch.Tensor, weight: AdoptedWeight) -> torch.Tensor:
        out = torch.empty(x.shape[0], weight.out_features, dtype=self.dtype)
        code = self.run(out, x, weight)
        if code != 0:
            raise ValueError(f"the {self.name} linear kernel refused its arguments (code {code})")
        return out

    def adopt(
        self, packed: torch.Tensor, out_features: int, in_features: int
    ) -> AdoptedWeight | None:
        """``packed`` (oneDNN's layout of an [out, in] weight) as a weight this kernel reads,
        or None where it cannot: a shape it does not walk, a buffer of another size or not
        on a cache line, or a probe product that disagrees with oneDNN's. A kernel reading
        another layout than oneDNN wrote pairs the wrong weights and misses by the outputs'
        own size, far beyond any rounding."""
        if not self.readable(out_features, in_features):
            return None
        if int(torch.ops.mkldnn._nbytes(packed)) != self.packed_bytes(out_features, in_features):
            return None
        address = int(torch.ops.mkldnn.data_ptr(packed))
        if address % 64:
            return None  # kernels load whole cache lines of weights (aligned AVX-512 loads)
        weight = AdoptedWeight(self, packed, out_features, in_features, address)
        probe = torch.randn(
            self.probe_rows, in_features, generator=torch.Generator().manual_seed(0)
        ).to(self.dtype)
        ours = weight.matmul(probe).float()
        theirs = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "").float()
        scale = float(theirs.abs().max())
        if float((ours - theirs).abs().max()) > self.tolerance * scale + 1e-6:
            return None
        return weight
