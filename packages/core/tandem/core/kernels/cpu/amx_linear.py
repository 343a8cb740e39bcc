"""bfloat16 linear layers at decode batch sizes on AMX tiles (``csrc/amx_linear.cpp``), gate/up
layers with SiLU-and-mul in the epilogue (``silu_matmul``).

A decode step streams every weight once; oneDNN's AMX kernels read the packed weights at
16-18 GB/s at M = 48 on a 2-core host, this kernel at ~19 (the weight stream one sequential
read per thread, prefetched a block ahead; 1.7 ms less per decode step of the bench model).
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
    c_function,
)
from tandem.core.kernels.cpu.native_linear import (
    AdoptedWeight,
    PackedWeightKernel,
    load_kernel_library,
)
from tandem.core.kernels.cpu.packed_experts import PackedExperts, bind_grouped, grouped_call
from tandem.core.kernels.process_once import ProcessOnce

logger = logging.getLogger(__name__)

SOURCE = CSRC / "amx_linear.cpp"
# Batches up to this many rows go to the AMX kernel (decode and small mixed steps).
MAX_ROWS = 64
_REQUIRED_FLAGS = frozenset({"amx_bf16", "amx_tile", "avx512_bf16"})
# Rows of the probe batch: two full tiles and a partial third, so both passes of the kernel
# and its partial-row stores are checked against oneDNN.
_PROBE_ROWS = 37


class AmxLinear(PackedWeightKernel):
    name = "AMX"
    dtype = torch.bfloat16
    max_rows = MAX_ROWS
    probe_rows = _PROBE_ROWS
    # Summed in another order, each output may differ by a bfloat16 rounding or two.
    tolerance = 2e-2

    def __init__(self, lib: ctypes.CDLL) -> None:
        if int(lib.tandem_amx_built()) != 1:
            raise OSError("the compiler did not target AMX-BF16 for this CPU")
        self.emulated = int(lib.tandem_amx_emulated()) == 1
        if not self.emulated and not amx_tiles_granted():
            raise OSError("Linux did not grant the AMX tile state (arch_prctl)")
        self.bind(lib.tandem_amx_linear)
        self._silu = c_function(lib.tandem_amx_linear_silu, list(self._function.argtypes))
        self._grouped = bind_grouped(lib.tandem_amx_grouped_linear, 0)
        self._grouped_silu = bind_grouped(lib.tandem_amx_grouped_silu, 0)

    def readable(self, out_features: int, in_features: int) -> bool:
        # Shapes off the 32-blocks are padded by oneDNN; the kernel does not walk padding.
        return out_features % 32 == 0 and in_features % 32 == 0

    def packed_bytes(self, out_features: int, in_features: int) -> int:
        return out_features * in_features * 2

    def silu_matmul(self, x: torch.Tensor, weight: AdoptedWeight) -> torch.Tensor | None:
        """The gate/up product with SiLU-and-mul as its epilogue -> [rows, out / 2], what
        ``silu_mul`` of the plain product gives, bit for bit (``csrc/amx_linear.cpp``);
        None where either half is off the 32-column units."""
        if weight.out_features % 64 != 0:
            return None
        out = torch.empty(x.shape[0], weight.out_features // 2, dtype=self.dtype)
        code = self._silu(
            out.data_ptr(), x.data_ptr(), weight.address, x.shape[0], weight.out_features,
            weight.in_features, x.stride(0), out.stride(0), torch.get_num_threads(),
        )  # fmt: skip
        if code != 0:
            raise ValueError(f"the {self.name} SiLU linear kernel refused its arguments ({code})")
        return out

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
        return PackedExperts(packed, experts, out_features, in_features, panel=32)

    def grouped_matmul(
        self, x: torch.Tensor, experts: PackedExperts, offsets: torch.Tensor
    ) -> torch.Tensor:
        """Rows ``offsets[e]`` to ``offsets[e + 1]`` of ``x`` [M, K] (sorted by expert) times
        expert ``e``'s weight, every expert in one call, at any M -> [M, N] (no host sync)."""
        return grouped_call(self._grouped, self.name, self.dtype, x, experts, offsets)

    def gates_silu(self, experts: PackedExperts) -> bool:
        """Whether ``grouped_silu_matmul`` takes these gate/up weights: both halves whole
        32-column units."""
        return experts.out_features % 64 == 0

    def grouped_silu_matmul(
        self, x: torch.Tensor, experts: PackedExperts, offsets: torch.Tensor
    ) -> torch.Tensor:
        """``grouped_matmul`` of the experts' gate/up weights [E, 2 I, K] with SiLU-and-mul
        as its epilogue -> [M, I], what ``silu_mul`` of the [M, 2 I] product gives, bit for
        bit."""
        return grouped_call(
            self._grouped_silu, f"{self.name} SiLU", self.dtype, x, experts, offsets,
            out_features=experts.out_features // 2,
        )  # fmt: skip


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
