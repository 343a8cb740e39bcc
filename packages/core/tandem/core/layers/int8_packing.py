"""The load step that repacks every int8 (W8A8) weight of a CPU model (linear layers and
routed experts), once, into the layout the CPU int8 kernel reads (``kernels/cpu/int8_gemm.py``);
the plain weight is then dropped, so the model keeps one copy."""

from __future__ import annotations

import logging

import torch
from torch import nn

from tandem.core.kernels.cpu.int8_gemm import native_int8
from tandem.core.layers.quantized_linear import QuantizableLinear
from tandem.core.layers.quantized_moe import QuantizedMoeExperts

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
        logger.info("packed %d int8 weights for the %s kernel", count, kernels.name)
    return count


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
