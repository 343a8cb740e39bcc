"""float32 and bfloat16 linear layers on AVX-512 FMAs and AVX512-BF16 dot products
(``csrc/avx512_linear.cpp``), for CPUs without AMX, at every batch size the engine runs;
and the routed experts of MoE models, each projection one grouped call for every active
expert (``packed_experts.py``).

On a 2-core AVX-512 host (AMD Zen 5) oneDNN's kernels leave the FMA units idle part of the
time at decode sizes: each weight panel comes from memory in one burst and is then computed
from cache while nothing streams. This kernel prefetches the next K chunk of a panel while
it computes the current one for a group of up to 512 rows, so the weight stream and the FMAs
overlap. Measured on the 33 weights of the bench model at M = 48 (2 threads, interleaved,
medians; see the source): float32 28.9 against 36.8 ms, bfloat16 14.3 against 18.9. At
prefill sizes it is level with oneDNN shape by shape (float32 at M = 2048: 21.1 against
20.2 ms for qkv_proj, 72.8 against 71.0 for gate_up_proj), so one kernel serves every step
of a server, mixed decode and prefill steps included. It reads the weight where oneDNN
packed it, so the model keeps one copy. Each weight is adopted only after the kernel's
product with it matched oneDNN's on a probe batch
(``native_linear.PackedWeightKernel.adopt``).

float32 only where the CPU has AVX-512F, bfloat16 where it has AVX512-BF16 too (on AMX CPUs
the AMX kernel takes bfloat16 decode batches); ``TANDEM_GEMM=onednn`` keeps oneDNN at every
batch size (said once in the log).

How the weight stream is prefetched is the one thing built per CPU vendor
(``WeightStreaming``): Intel cores hold a PREFETCHNTA line in one of their few L1 fill
buffers until it arrives, so there the kernel prefetches into L2 (on the AMX Xeon, float32 at
one row 29.0 -> 16.9 ms for the bench model's weights); AMD keeps the streaming it was tuned
with.
"""

from __future__ import annotations

import ctypes
import enum
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.core.kernels.cpu.native_build import CSRC, IsaLevel
from tandem.core.kernels.cpu.native_linear import (
    PackedWeightKernel,
    load_kernel_library,
)
from tandem.core.kernels.cpu.packed_experts import (
    GroupedPanelCalls,
    PackedExperts,
    pack_panels,
)
from tandem.core.kernels.process_once import ProcessOnce
from tandem.device.cpu import cpu_vendor

logger = logging.getLogger(__name__)

SOURCE = CSRC / "avx512_linear.cpp"
# Batches up to this many rows go to the kernel: every step of the default token budget
# (2048) and more. Measured on the 33 bench weights in sequence, float32: ahead of oneDNN
# from M = 8 to M = 128, level around M = 300, ahead again at M = 512 to 4096 (2443 against
# 2727 ms at 4096). Larger batches go to oneDNN.
MAX_ROWS = 8192
# The columns of one packed panel (the kernel reads only whole panels), and the multiple
# oneDNN pads a float32 panel's K rows to.
PANEL = 64
K_PAD = 16
# Rows of the probe batch: six full register blocks of six and a partial seventh of five.
_PROBE_ROWS = 41


class WeightStreaming(enum.Enum):
    """How the kernel asks for the weight it streams from memory (see the source)."""

    # Chunks of 384 steps, the next prefetched into L1, single-row-block passes PREFETCHNTA
    # (kept out of the L3, where the rest of a step's state stays): tuned on AMD Zen 4 / 5.
    NTA = "nta"
    # Every prefetch into L2, chunks of 128 steps for up to 96 rows, and batches of more
    # than 384 rows in groups of about 128: Intel.
    L2 = "l2"

    @classmethod
    def for_vendor(cls, vendor: str) -> WeightStreaming:
        return cls.L2 if vendor == "GenuineIntel" else cls.NTA

    @property
    def defines(self) -> tuple[str, ...]:
        return ("TANDEM_STREAM_TO_L2",) if self is WeightStreaming.L2 else ()

    @property
    def description(self) -> str:
        if self is WeightStreaming.L2:
            return "weights prefetched into L2 (Intel: PREFETCHNTA waits in L1 fill buffers)"
        return "weights of single-row-block passes streamed PREFETCHNTA (AMD tuning)"


class Avx512Linear(PackedWeightKernel, GroupedPanelCalls):
    """The kernel for one dtype: float32 (AVX-512F FMAs) or bfloat16 (AVX512-BF16)."""

    max_rows = MAX_ROWS
    probe_rows = _PROBE_ROWS
    panel = PANEL

    def __init__(
        self, lib: ctypes.CDLL, dtype: torch.dtype, streaming: WeightStreaming | None = None
    ) -> None:
        self.dtype = dtype
        if streaming is not None:
            self.detail = streaming.description
        float32 = dtype is torch.float32
        self.name = "AVX-512 float32" if float32 else "AVX512-BF16"
        suffix = "f32" if float32 else "bf16"
        self.bind(getattr(lib, f"tandem_avx512_linear_{suffix}"), limits=(MAX_ROWS,),
                  silu=getattr(lib, f"tandem_avx512_linear_silu_{suffix}"))  # fmt: skip
        self.bind_grouped_calls(getattr(lib, f"tandem_avx512_grouped_linear_{suffix}"),
                                getattr(lib, f"tandem_avx512_grouped_silu_{suffix}"))  # fmt: skip
        # Summed in another order, each output differs by float32 roundings (~1e-6), or by
        # a bfloat16 rounding or two.
        self.tolerance = 1e-4 if float32 else 2e-2

    def readable(self, out_features: int, in_features: int) -> bool:
        # Columns off the 64-wide panels are padded by oneDNN; the kernel does not walk them.
        # bfloat16 K is padded too (to 32 seen here): taken only where it needs none.
        if self.dtype is torch.bfloat16:
            return out_features % PANEL == 0 and in_features % 32 == 0
        return out_features % PANEL == 0 and in_features >= 1

    def packed_bytes(self, out_features: int, in_features: int) -> int:
        if self.dtype is torch.bfloat16:
            return out_features * in_features * 2
        return out_features * (-(-in_features // K_PAD) * K_PAD) * 4

    def pack_experts(self, weight: torch.Tensor) -> PackedExperts | None:
        """``weight`` [E, N, K] of this kernel's dtype in its grouped layout
        (``packed_experts``); None where N is off the 64-column panels or a bfloat16 K is
        odd."""
        _, out_features, in_features = weight.shape
        if weight.dtype is not self.dtype or out_features % PANEL != 0:
            return None
        if self.dtype is torch.bfloat16 and in_features % 2 != 0:
            return None
        packed = pack_panels(weight, PANEL)
        # The kernel loads each panel step with aligned loads (torch's CPU allocator gives
        # 64-byte alignment; anything else stays on the torch path rather than fault).
        return packed if packed.packed.data_ptr() % 64 == 0 else None


@dataclass(frozen=True)
class Avx512Kernels:
    float32: Avx512Linear
    # None where the CPU lacks AVX512-BF16.
    bfloat16: Avx512Linear | None


def load_avx512_linear(
    build_dir: Path | None = None,
    isa: IsaLevel | None = None,
    streaming: WeightStreaming | None = None,
) -> Avx512Kernels | None:
    """Build (if needed) and load the kernels; None where this CPU or process cannot run them
    (the reason logged). ``streaming``: default, this CPU vendor's."""
    streaming = streaming or WeightStreaming.for_vendor(cpu_vendor())
    lib = load_kernel_library(
        "AVX-512", SOURCE, frozenset({"avx512f"}), build_dir, isa, streaming.defines
    )
    if lib is None:
        return None
    built = int(lib.tandem_avx512_built())
    if built == 0:
        logger.warning("no AVX-512 linear kernel (the compiler did not target AVX-512)")
        return None
    bf16 = Avx512Linear(lib, torch.bfloat16, streaming) if built == 2 else None
    return Avx512Kernels(float32=Avx512Linear(lib, torch.float32, streaming), bfloat16=bf16)


# The process's kernels, built and loaded on first use.
avx512_linear = ProcessOnce(load_avx512_linear)
