"""Linear layers whose weight is packed once, at load, into oneDNN's blocked layout (CPU).

``F.linear`` on CPU hands oneDNN (bfloat16) or MKL (float32) a plain row-major weight, which
the library reorders into its blocked layout on every call. At decode batch sizes a step is
bound by memory traffic, and that reorder reads and writes every weight once more per step.
vLLM's CPU build packs its weights once (``create_onednn_mm``), as inductor does when it
freezes a model; so do we. Measured on an AMX Xeon (2 threads, x [48, 1024] against a
[5632, 1024] weight): bfloat16 964 -> 1685 GFLOP/s, float32 250 -> 366 (see
``benchmarks/attention_step.py`` for the whole step).

Packing is a choice of weight layout made once per model after loading
(``pack_linear_weights``), on CPU, for float32 and bfloat16 where oneDNN is built in;
``TANDEM_GEMM=torch`` keeps plain weights and ``F.linear`` (said once in the log). A packed
layer drops its plain weight (no second copy of the model) unless another module shares it
(an LM head tied to the embedding keeps the embedding's). The packed weights are then moved
onto 2 MiB pages where Linux can (``collapse_to_huge_pages``): a decode step streams them all.
Where the CPU has them, our own kernels read the same packed weights (``native_linear``):
``amx_linear`` takes bfloat16 decode batches on AMX CPUs, ``avx512_linear`` float32 (and
bfloat16 without AMX) batches of every size on AVX-512 CPUs.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from tandem.core.kernels.cpu.amx_linear import amx_linear
from tandem.core.kernels.cpu.avx2_linear import avx2_linear
from tandem.core.kernels.cpu.avx512_linear import avx512_linear
from tandem.core.kernels.cpu.native_linear import AdoptedWeight, PackedWeightKernel
from tandem.device.cpu import collapse_to_huge_pages

logger = logging.getLogger(__name__)

# The batch size oneDNN picks the blocked layout for. Measured on AMX, bf16 and fp32: any hint
# from 48 to 2048 gives the same throughput from decode (M = 8) to prefill (M = 2048); a hint
# of 1 loses 15-20% at M = 48.
_LAYOUT_BATCH_HINT = 128
_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


class PackableLinear(nn.Module):
    """A layer computing ``x W^T (+ b)`` with W = ``self.weight`` [out, in]; once packed,
    ``self.packed`` holds W in oneDNN's layout and ``weight`` may be empty."""

    weight: nn.Parameter
    packed: torch.Tensor | None = None
    # The packed weight as our own kernel reads it, where one adopted it, else None.
    native: AdoptedWeight | None = None
    # Set by the layer's owner where every consumer of its output takes a strided view (rows
    # apart by more than their width): the packed weight may then carry zero output rows up
    # to a width our kernel reads (its panels), so a layer with a few outputs off the panels
    # does not fall back to oneDNN; ``matmul`` returns a view of the true columns.
    pad_outputs: bool = False
    # Zero output rows the packed weight carries past the true ones.
    padded_outputs: int = 0

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        packed = self.packed
        if packed is None:
            return F.linear(x, self.weight, bias)
        out = self._packed_matmul(packed, x, bias)
        pad = self.padded_outputs
        return out[..., : out.shape[-1] - pad] if pad else out

    def silu_matmul(self, x: torch.Tensor) -> torch.Tensor | None:
        """For a gate/up layer (W = [gate; up], no bias): silu(x G^T) * (x U^T) in one call
        of the native kernel, where it fuses the activation into its epilogue; None where it
        does not (the caller then runs ``matmul`` and the activation)."""
        native = self.native
        if native is None or self.padded_outputs or getattr(self, "bias", None) is not None:
            return None
        if x.dim() != 2 or x.shape[0] > native.max_rows:
            return None
        return native.kernel.silu_matmul(x if x.stride(1) == 1 else x.contiguous(), native)

    def _packed_matmul(
        self, packed: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        rows = x.shape[0]
        native = self.native
        if native is not None and bias is None and x.dim() == 2 and rows <= native.max_rows:
            return native.matmul(x if x.stride(1) == 1 else x.contiguous())
        padded = padded_rows(rows)
        if x.dim() == 2 and padded != rows:
            x = torch.cat((x, x.new_zeros(padded - rows, x.shape[1])))
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return out[:rows]


def padded_rows(rows: int) -> int:
    """``rows`` rounded up to three significant bits (at most 1/8 more rows; batch sizes
    like 48 or 2048 stay as they are). oneDNN keeps memory for every input shape it has run
    (measured: ~0.6 MB a row count, for good), and a server runs every token count from 1
    to its batch budget; rounded, a budget of 2048 gives ~70 shapes instead of 2048
    (+1.2 GB of RSS for four weights over every count, +0.1-0.2 GB rounded)."""
    if rows <= 8:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


@functools.cache
def packing_enabled(dtype: torch.dtype) -> bool:
    """Whether CPU weights of ``dtype`` are packed (decided once per process and dtype)."""
    if os.environ.get("TANDEM_GEMM", "").lower() == "torch":
        logger.info("TANDEM_GEMM=torch: linear layers keep plain weights (F.linear)")
        return False
    if dtype not in _PACKABLE_DTYPES or not torch._C._has_mkldnn:
        return False
    # oneDNN runs bf16 only where the CPU has AVX512-BF16/AMX (or emulates it with AVX512).
    return dtype is not torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linear_weights(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Pack every ``PackableLinear`` of a loaded CPU model; returns how many were packed."""
    if device.type != "cpu" or not packing_enabled(dtype):
        return 0
    owners: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        owners[id(param)] = owners.get(id(param), 0) + 1
    count = adopted = 0
    kernel = native_kernel(dtype)
    for module in model.modules():
        if not isinstance(module, PackableLinear) or module.packed is not None:
            continue
        # None: a 4-bit layer, whose codes its own kernel reads.
        weight: nn.Parameter | None = module.weight
        if weight is None or weight.dtype is not dtype or weight.dim() != 2 or weight.numel() == 0:
            continue
        _pack(module, weight, kernel)
        if owners[id(weight)] == 1:
            weight.data = torch.empty((0, weight.shape[1]), dtype=dtype, device=device)
        count += 1
        adopted += module.native is not None
    moved = collapse_to_huge_pages(
        _memory_range(m.packed)
        for m in model.modules()
        if isinstance(m, PackableLinear) and m.packed is not None
    )
    logger.info(
        "packed %d linear weights into oneDNN's layout (%s); %.0f MiB of them on 2 MiB pages",
        count,
        dtype,
        moved / 2**20,
    )
    if kernel is not None:
        logger.info(
            "%d of them read by the %s kernel at batches of up to %d rows",
            adopted,
            kernel.name,
            kernel.max_rows,
        )
    return count


def _pack(module: PackableLinear, weight: torch.Tensor, kernel: PackedWeightKernel | None) -> None:
    """Pack ``weight`` into ``module`` and let ``kernel`` adopt it where it can: padded
    with zero output rows to the width the kernel reads where the module allows it, and
    unpadded where the kernel still declines it (oneDNN would then compute the padding).
    A layer with a bias is never padded: oneDNN adds the bias over the weight's whole
    width, and our kernel (which takes none) hands such a layer to oneDNN anyway."""
    out_features, in_features = weight.shape
    width = out_features
    if kernel is not None and module.pad_outputs and getattr(module, "bias", None) is None:
        width = kernel.readable_width(out_features, in_features) or out_features
    for rows in dict.fromkeys((width, out_features)):  # padded first, then as it is
        padded = weight.detach()
        if rows > out_features:
            padded = torch.cat((padded, padded.new_zeros(rows - out_features, in_features)))
        module.packed = torch.ops.mkldnn._reorder_linear_weight(padded, _LAYOUT_BATCH_HINT)
        module.padded_outputs = rows - out_features
        module.native = None if kernel is None else kernel.adopt(module.packed, rows, in_features)
        if module.native is not None:
            return


def native_kernel(dtype: torch.dtype) -> PackedWeightKernel | None:
    """Our kernel for packed weights of ``dtype`` on this CPU, or None (oneDNN only)."""
    amx = amx_linear() if dtype is torch.bfloat16 else None
    if amx is not None:
        return amx
    avx512 = avx512_linear()
    if avx512 is None:
        return avx2_linear() if dtype is torch.float32 else None
    if dtype is torch.float32:
        return avx512.float32
    return avx512.bfloat16 if dtype is torch.bfloat16 else None


def _memory_range(packed: torch.Tensor) -> tuple[int, int]:
    """Where a packed (oneDNN, opaque) tensor's bytes lie: [start, end)."""
    start = int(torch.ops.mkldnn.data_ptr(packed))
    return start, start + int(torch.ops.mkldnn._nbytes(packed))


def packed_bytes(model: nn.Module) -> int:
    """Bytes the packed weights of ``model`` take (beside its parameters)."""
    return sum(
        m.packed.numel() * m.packed.element_size()
        for m in model.modules()
        if isinstance(m, PackableLinear) and m.packed is not None
    )
