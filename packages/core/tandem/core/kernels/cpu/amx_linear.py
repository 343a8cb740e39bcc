"""bfloat16 linear layers at decode batch sizes on AMX tiles (``csrc/amx_linear.cpp``), gate/up
layers with SiLU-and-mul in the epilogue (``silu_matmul``).

A decode step streams every weight once; oneDNN's AMX kernels read the packed weights at
16-18 GB/s at M = 48 on a 2-core host, this kernel at ~19 (the weight stream one sequential
read per thread, prefetched ahead of the tiles; 1.7 ms less per decode step of the bench
model, measured with the prefetch a block ahead, before ``kAhead``).
It reads the weight where oneDNN packed it, so the model keeps one copy: prefill-size
batches (more than ``MAX_ROWS`` rows) stay with oneDNN. oneDNN does not document its packed
layout; each weight is adopted only after the kernel's product with it matched oneDNN's on a
probe batch (``native_linear.PackedWeightKernel.adopt``).

The routed experts of MoE models go through its grouped form at every batch size
(``pack_experts``, ``grouped_matmul``, ``grouped_silu_matmul``; ``packed_experts.py``), each
expert's weight in the same layout.

Only where the CPU has AMX-BF16 and Linux grants the tile state; ``TANDEM_GEMM=onednn``
keeps oneDNN at every batch size (said once in the log). A test build
(``AMX_EMULATION_DEFINE``) runs the kernel on tiles emulated as Intel documents them, on any
CPU, for weights laid out as the source says (``pack_amx_layout``).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from tandem.core.kernels.cpu.native_build import (
    AMX_EMULATION_DEFINE,
    CSRC,
    IsaLevel,
    amx_tiles_granted,
)
from tandem.core.kernels.cpu.native_linear import PackedWeightKernel, load_kernel_library
from tandem.core.kernels.cpu.packed_experts import GroupedPanelCalls, PackedExperts
from tandem.core.kernels.process_once import ProcessOnce

logger = logging.getLogger(__name__)

SOURCE = CSRC / "amx_linear.cpp"
# Batches up to this many rows go to the AMX kernel (decode and small mixed steps).
MAX_ROWS = 64
_REQUIRED_FLAGS = frozenset({"amx_bf16", "amx_tile", "avx512_bf16"})
# Rows of the probe batch: two full x tiles and a partial third, so the kernel's pass over
# three tiles and its partial-row stores are checked against oneDNN.
_PROBE_ROWS = 37


class AmxLinear(PackedWeightKernel, GroupedPanelCalls):
    name = "AMX"
    dtype = torch.bfloat16
    max_rows = MAX_ROWS
    probe_rows = _PROBE_ROWS
    # Units of 32 columns: two 16-column tiles (pack_amx_layout).
    panel = 32
    # Summed in another order, each output may differ by a bfloat16 rounding or two.
    tolerance = 2e-2

    def __init__(self, lib: ctypes.CDLL) -> None:
        if int(lib.tandem_amx_built()) != 1:
            raise OSError("the compiler did not target AMX-BF16 for this CPU")
        self.emulated = int(lib.tandem_amx_emulated()) == 1
        if not self.emulated and not amx_tiles_granted():
            raise OSError("Linux did not grant the AMX tile state (arch_prctl)")
        self.bind(lib.tandem_amx_linear, silu=lib.tandem_amx_linear_silu)
        self.bind_grouped_calls(lib.tandem_amx_grouped_linear, lib.tandem_amx_grouped_silu)

    def readable(self, out_features: int, in_features: int) -> bool:
        # Shapes off the 32-blocks are padded by oneDNN; the kernel does not walk padding.
        return out_features % 32 == 0 and in_features % 32 == 0

    def packed_bytes(self, out_features: int, in_features: int) -> int:
        return out_features * in_features * 2

    def pack_experts(self, weight: torch.Tensor) -> PackedExperts | None:
        """``weight`` bfloat16 [E, N, K] with each expert in ``pack_amx_layout``'s layout, one
        after another; None where N or K is off the 32-blocks."""
        experts, out_features, in_features = weight.shape
        if weight.dtype is not torch.bfloat16 or not self.readable(out_features, in_features):
            return None
        packed = pack_amx_layout(weight.detach())
        # The kernel stores packed x tiles with aligned stores but loads weight tiles from
        # any address; 64-byte alignment keeps each weight row of a tile one cache line.
        if packed.data_ptr() % 64 != 0:
            return None
        return PackedExperts(packed, experts, out_features, in_features, self.panel)


def pack_amx_layout(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` bfloat16 [..., N, K] (multiples of 32) in the layout the kernel reads, the
    one oneDNN packs for AMX: [..., N / 32][K / 32][16 k-pairs][32 n][2 k]."""
    *lead, n, k = weight.shape
    blocks = weight.reshape(*lead, n // 32, 32, k // 32, 16, 2)  # [N/32][32 n][K/32][16][2]
    d = len(lead)
    return blocks.permute(*range(d), d, d + 2, d + 3, d + 1, d + 4).contiguous()


def load_amx_linear(
    build_dir: Path | None = None, isa: IsaLevel | None = None, emulated: bool = False
) -> AmxLinear | None:
    """Build (if needed) and load the kernel; None where this CPU or process cannot run it
    (the reason logged). ``emulated``: the test build on emulated tiles, on any CPU."""
    if emulated:
        lib = load_kernel_library("AMX (emulated)", SOURCE, frozenset(), build_dir, isa,
                                  (AMX_EMULATION_DEFINE,))  # fmt: skip
    else:
        lib = load_kernel_library("AMX", SOURCE, _REQUIRED_FLAGS, build_dir, isa)
    if lib is None:
        return None
    try:
        return AmxLinear(lib)
    except OSError as exc:
        logger.warning("no AMX linear kernel (%s); decode batches use oneDNN", exc)
        return None


# The process's kernel, built and loaded on first use.
amx_linear = ProcessOnce(load_amx_linear)
