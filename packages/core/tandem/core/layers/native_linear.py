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

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


def onednn_only() -> bool:
    """``TANDEM_GEMM=onednn``: every batch size goes to oneDNN (the A side of an A/B)."""
    return os.environ.get("TANDEM_GEMM", "").lower() == "onednn"


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

    @abstractmethod
    def readable(self, out_features: int, in_features: int) -> bool:
        """Whether the kernel walks oneDNN's layout for this shape (no padding it skips)."""

    @abstractmethod
    def packed_bytes(self, out_features: int, in_features: int) -> int:
        """The size of oneDNN's buffer in the layout the kernel reads."""

    @abstractmethod
    def run(self, out: torch.Tensor, x: torch.Tensor, weight: AdoptedWeight) -> int:
        """Computes ``out = x W^T``; 0, or the kernel's code for arguments it refused."""

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
