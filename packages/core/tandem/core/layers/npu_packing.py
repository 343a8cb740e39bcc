"""The load step that puts a model's quantized weights into the layouts torch_npu's matmuls
read (``kernels/npu/layouts.py``), once, where the device runtime launches torch_npu's ops:
each W8A8 layer's scale as the (N,) float32 ``npu_quant_matmul`` takes, and each 4-bit
layer's codes packed by ``npu_convert_weight_to_int4pack`` with its scales and offsets
transposed to [G, N] in the model's dtype (its checkpoint-layout tensors are then emptied, so
the model keeps one copy). A 4-bit layer the op cannot take keeps the CPU layout and the
torch reference, and the log says why. Routed experts keep the reference (``handles.py``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from tandem.core.kernels import handles
from tandem.core.kernels.handle import TORCH_NPU
from tandem.core.kernels.npu.layouts import int4_unsupported, int8_scale_layout, npu_int4_layout
from tandem.core.kernels.npu.loading import HALVES, torch_npu_kernel
from tandem.core.layers.int4_weights import Int4Parameters
from tandem.core.layers.quantized_linear import QuantizableLinear

logger = logging.getLogger(__name__)


def _int4_served(families: Sequence[str], dtype: torch.dtype) -> bool:
    """Whether ``int4_linear`` resolves to torch_npu's kernel for ``dtype`` here: only then
    may a layer hold the op's layout, which the other kernels cannot read."""
    npu = torch_npu_kernel("int4_linear", "int4_linear", HALVES)(dtype)
    return npu is not None and handles.int4_linear().choose(families, dtype) is npu


def _not_served(dtype: torch.dtype) -> str:
    """Why torch_npu's 4-bit kernel does not serve ``dtype`` here (``_int4_served`` said no)."""
    if dtype not in HALVES:
        return f"npu_weight_quant_batchmatmul takes float16 and bfloat16 activations, not {dtype}"
    return "torch_npu does not import (see its warning above)"


def npu_int4_bytes(model: nn.Module) -> int:
    """Bytes of the 4-bit weights laid out for torch_npu's op: they live beside the
    parameters, which were emptied."""
    return sum(
        module.int4.npu.nbytes
        for module in model.modules()
        if isinstance(module, QuantizableLinear)
        and module.int4 is not None
        and module.int4.npu is not None
    )


def _pack_int4(name: str, int4: Int4Parameters, dtype: torch.dtype) -> bool:
    if int4.kernel_g_idx() is not None:
        logger.info(
            "%s keeps the torch 4-bit reference on NPU: its activation-order groups are "
            "uneven on this rank, which the op's consecutive groups cannot express",
            name,
        )
        return False
    reason = int4_unsupported(int4.qweight.data, int4.scales.data)
    if reason is not None:
        logger.info("%s keeps the torch 4-bit reference on NPU: %s", name, reason)
        return False
    int4.npu = npu_int4_layout(int4.qweight.data, int4.scales.data, int4.qzeros.data, dtype)
    for param in (int4.qweight, int4.scales, int4.qzeros):
        param.data = param.data.new_empty(0)
    return True


def pack_npu_quantized_weights(
    model: nn.Module, dtype: torch.dtype, families: Sequence[str]
) -> int:
    """Lay out the quantized linear layers of a loaded model for torch_npu's ops; how many
    were laid out (none where the runtime does not launch torch_npu's ops)."""
    if TORCH_NPU not in families:
        return 0
    int4_served = _int4_served(families, dtype)
    int8 = int4 = 0
    kept: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, QuantizableLinear):
            continue
        if module.weight_scale is not None:
            module.weight_scale.data = int8_scale_layout(module.weight_scale.data)
            int8 += 1
        elif module.int4 is not None and module.int4.npu is None:
            if int4_served:
                int4 += _pack_int4(name, module.int4, dtype)
            else:
                kept.append(name)
    if kept:
        logger.info(
            "%s keep the torch 4-bit reference on NPU: %s", ", ".join(kept), _not_served(dtype)
        )
    if int8 or int4:
        logger.info(
            "laid out %d int8 and %d 4-bit weights for torch_npu's quantized matmuls", int8, int4
        )
    return int8 + int4
