"""The load step that repacks every int8 (W8A8) weight of a CPU model (linear layers and
routed experts), once, into the layout the CPU int8 kernel reads (``kernels/cpu/int8_gemm.py``);
the plain weight is then dropped, so the model keeps one copy."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from torch import nn

from tandem.core.kernels.cpu.int8_gemm import PackedInt8Experts, PackedInt8Weight, native_int8
from tandem.core.layers.quantized_linear import QuantizableLinear
from tandem.core.layers.quantized_moe import QuantizedMoeExperts
from tandem.device.cpu import collapse_to_huge_pages, tensor_bytes

logger = logging.getLogger(__name__)


def pack_int8_weights(model: nn.Module, device: torch.device) -> int:
    """Pack the int8 weights of a loaded model on ``device``; how many were packed (none
    off CPU, or where the kernel library cannot be had: the layers then run the reference
    on their plain weights)."""
    if device.type != "cpu":
        return 0
    kernels = native_int8()
    if kernels is None:
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, QuantizedMoeExperts):
            count += module.pack_int8(kernels)
            continue
        if not isinstance(module, QuantizableLinear) or module.weight_scale is None:
            continue
        weight = module.weight
        if module.int8_packed is not None or weight.dtype is not torch.int8 or weight.dim() != 2:
            continue
        module.int8_packed = kernels.pack(weight)
        weight.data = torch.empty((0, weight.shape[1]), dtype=torch.int8, device=device)
        count += 1
    if count:
        # Decode streams every packed weight once a step: 2 MiB pages, as for float ones.
        moved = collapse_to_huge_pages(tensor_bytes(t) for t in _int8_tensors(model))
        logger.info("packed %d int8 weights for the %s kernel; %.0f MiB of them on 2 MiB pages",
                    count, kernels.name, moved / 2**20)  # fmt: skip
    return count


def _int8_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """The packed int8 weights of ``model`` (codes and compensations)."""
    for module in model.modules():
        packs: list[PackedInt8Experts | PackedInt8Weight | None]
        if isinstance(module, QuantizedMoeExperts):
            packs = [module.w13.packed, module.w2.packed]
        elif isinstance(module, QuantizableLinear):
            packs = [module.int8_packed]
        else:
            continue
        for pack in packs:
            if pack is not None:
                yield pack.packed
                yield pack.compensation


def int8_packed_bytes(model: nn.Module) -> int:
    """Bytes the int8 weights packed for the CPU kernel take (beside the parameters, which
    no longer hold them)."""
    total = 0
    for module in model.modules():
        if isinstance(module, QuantizedMoeExperts):
            total += module.packed_bytes()
        elif isinstance(module, QuantizableLinear) and module.int8_packed is not None:
            total += module.int8_packed.nbytes
    return total
