"""float32 linear layers on AVX2 FMAs (``csrc/avx2_linear.cpp``), for CPUs without AVX-512,
at every batch size the engine runs.

On a 2-core AVX2 host (AMD EPYC Zen 1: FMA peak 80 GFLOP/s over both cores, memory 24.5
GB/s, so 3.3 FLOPs per byte in balance) a float32 step is bound by arithmetic from about 8
sequences up. oneDNN's packed kernels reach 39-73 GFLOP/s there; this one keeps the FMA
pipes busier with a 6 x 16 register block and a prefetched weight stream (53 against 38 at
M = 8, 77 against 71 at M = 48, 71 against 65 at M = 2048, see
``benchmarks/linear_kernels.py``). It reads the weight where oneDNN packed it, so the model
keeps one copy: oneDNN's AVX2 layout is [N/P][Kp][P], P = 64 for most shapes and 16 for
some; each weight is adopted, with its panel width, only after the kernel's product with it
matched oneDNN's on a probe batch (``native_linear.PackedWeightKernel.adopt``).

Gate/up projections whose halves fill whole panels run SiLU-and-mul in the same call
(``silu_matmul``, and ``grouped_silu_matmul`` for routed experts): the [rows, 2 I] product is
summed into scratch a panel pair at a time and activated there, never written out and read
back, equal to the bit to the elementwise kernel on the unfused product.

float32 only, where the CPU has AVX2 and FMA and not AVX-512 (which has its own kernel);
``TANDEM_GEMM=onednn`` keeps oneDNN at every batch size (said once in the log).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from tandem.core.kernels.cpu.native_build import CSRC, IsaLevel
from tandem.core.kernels.cpu.native_linear import (
    AdoptedWeight,
    PackedWeightKernel,
    load_kernel_library,
)
from tandem.core.kernels.cpu.packed_experts import (
    GroupedPanelCalls,
    PackedExperts,
    pack_panels,
)
from tandem.core.kernels.process_once import ProcessOnce

logger = logging.getLogger(__name__)

SOURCE = CSRC / "avx2_linear.cpp"
# Batches up to this many rows go to the kernel, larger ones to oneDNN: on a 2-core Zen 1
# guest (`benchmarks/linear_kernels.py`, the bench model's 33 weights) the kernel is 13%
# ahead at 48 rows, level at 96 and 128, and 3-10% behind from 192 to 2048, where oneDNN's
# blocking for cache pays and the weight stream no longer limits.
MAX_ROWS = 128
# Panel widths oneDNN's AVX2 layouts use, the wider (more common) tried first.
PANELS = (64, 16)
K_PAD = 16
# Rows of the probe batch: six full register blocks of six and a partial seventh of five.
_PROBE_ROWS = 41


class Avx2Linear(PackedWeightKernel, GroupedPanelCalls):
    """The float32 kernel on AVX2 FMAs, reading panels of ``panel`` columns; ``adopt``
    tries the other panel width where this one's probe disagrees with oneDNN."""

    name = "AVX2 float32"
    dtype = torch.float32
    max_rows = MAX_ROWS
    probe_rows = _PROBE_ROWS
    # Summed in another order than oneDNN's: outputs differ by float32 roundings (~1e-6 of
    # their scale); a misread layout misses by the outputs' own size.
    tolerance = 1e-4

    def __init__(self, lib: ctypes.CDLL, panel: int = PANELS[0], max_rows: int = MAX_ROWS) -> None:
        self.panel = panel
        self.max_rows = max_rows
        self._lib = lib
        self.bind(lib.tandem_avx2_linear_f32, limits=(max_rows, panel),
                  silu=lib.tandem_avx2_linear_silu_f32)  # fmt: skip
        self.bind_grouped_calls(lib.tandem_avx2_grouped_linear_f32,
                                lib.tandem_avx2_grouped_silu_f32, takes_panel=True)  # fmt: skip
        self._others = (
            [Avx2Linear(lib, p, max_rows) for p in PANELS if p != panel]
            if panel == PANELS[0]
            else []
        )

    def taking_rows(self, max_rows: int) -> Avx2Linear:
        """The same kernel taking batches of up to ``max_rows`` rows (the kernel itself takes
        any number, in groups of 512; MAX_ROWS is where serving hands over to oneDNN)."""
        return Avx2Linear(self._lib, self.panel, max_rows)

    def readable(self, out_features: int, in_features: int) -> bool:
        # Columns off whole panels are padded by oneDNN; the kernel does not walk them.
        return out_features % self.panel == 0 and in_features >= 1

    def packed_bytes(self, out_features: int, in_features: int) -> int:
        return out_features * (-(-in_features // K_PAD) * K_PAD) * 4

    def pack_experts(self, weight: torch.Tensor) -> PackedExperts | None:
        return pack_experts(weight)

    def adopt(
        self, packed: torch.Tensor, out_features: int, in_features: int
    ) -> AdoptedWeight | None:
        adopted = super().adopt(packed, out_features, in_features)
        for other in self._others:
            if adopted is not None:
                break
            adopted = other.adopt(packed, out_features, in_features)
        return adopted


def pack_experts(weight: torch.Tensor) -> PackedExperts | None:
    """``weight`` [E, N, K] float32 packed for ``Avx2Linear.grouped_matmul``; None for an N
    off the 16-column panels (those experts stay on the torch path)."""
    panel = next((p for p in PANELS if weight.shape[1] % p == 0), None)
    if panel is None or weight.dtype is not torch.float32:
        return None
    return pack_panels(weight, panel)


def load_avx2_linear(
    build_dir: Path | None = None, isa: IsaLevel | None = None
) -> Avx2Linear | None:
    """Build (if needed) and load the kernel; None where this CPU or process cannot run it
    (the reason logged)."""
    lib = load_kernel_library("AVX2", SOURCE, frozenset({"avx2", "fma"}), build_dir, isa)
    if lib is None:
        return None
    if int(lib.tandem_avx2_built()) == 0:
        logger.warning("no AVX2 linear kernel (the compiler did not target AVX2 with FMA)")
        return None
    return Avx2Linear(lib)


# The process's kernel, built and loaded on first use.
avx2_linear = ProcessOnce(load_avx2_linear)
