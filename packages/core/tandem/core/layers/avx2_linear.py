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

float32 only, where the CPU has AVX2 and FMA and not AVX-512 (which has its own kernel);
``TANDEM_GEMM=onednn`` keeps oneDNN at every batch size (said once in the log).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from tandem.core.layers.native_build import CSRC, IsaLevel, ProcessOnce
from tandem.core.layers.native_linear import (
    AdoptedWeight,
    PackedWeightKernel,
    load_kernel_library,
)

logger = logging.getLogger(__name__)

SOURCE = CSRC / "avx2_linear.cpp"
# Batches up to this many rows go to the kernel (every step of the default token budget and
# more); larger ones to oneDNN.
MAX_ROWS = 8192
# Panel widths oneDNN's AVX2 layouts use, the wider (more common) tried first.
PANELS = (64, 16)
K_PAD = 16
# Rows of the probe batch: six full register blocks of six and a partial seventh of five.
_PROBE_ROWS = 41


class Avx2Linear(PackedWeightKernel):
    """The float32 kernel on AVX2 FMAs, reading panels of ``panel`` columns; ``adopt``
    tries the other panel width where this one's probe disagrees with oneDNN."""

    name = "AVX2 float32"
    dtype = torch.float32
    max_rows = MAX_ROWS
    probe_rows = _PROBE_ROWS
    # Summed in another order than oneDNN's: outputs differ by float32 roundings (~1e-6 of
    # their scale); a misread layout misses by the outputs' own size.
    tolerance = 1e-4

    def __init__(self, lib: ctypes.CDLL, panel: int = PANELS[0]) -> None:
        self.panel = panel
        self.bind(lib.tandem_avx2_linear_f32, limits=(MAX_ROWS, panel))
        self._others = (
            [Avx2Linear(lib, p) for p in PANELS if p != panel] if panel == PANELS[0] else []
        )

    def readable(self, out_features: int, in_features: int) -> bool:
        # Columns off whole panels are padded by oneDNN; the kernel does not walk them.
        return out_features % self.panel == 0 and in_features >= 1

    def packed_bytes(self, out_features: int, in_features: int) -> int:
        return out_features * (-(-in_features // K_PAD) * K_PAD) * 4

    def adopt(
        self, packed: torch.Tensor, out_features: int, in_features: int
    ) -> AdoptedWeight | None:
        adopted = super().adopt(packed, out_features, in_features)
        for other in self._others:
            if adopted is not None:
                break
            adopted = other.adopt(packed, out_features, in_features)
        return adopted


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
