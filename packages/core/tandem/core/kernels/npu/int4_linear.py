"""The W4A16 linear through ``torch_npu.npu_weight_quant_batchmatmul``, as vllm-ascend calls
it for weight-only layers (``quantization/methods/w8a16.py``): the activations times the
weight dequantized in the op, ``(w + antiquant_offset) * antiquant_scale`` per group of
inputs, from the int4 words ``npu_convert_weight_to_int4pack`` packed once at load
(``layouts.NpuInt4Weight``, ``layers/npu_packing.py``).

A layer left in the CPU layout (its groups are not the op's, or activation order whose groups
are uneven on this rank: ``g_idx``) reaches this kernel with its plain codes and runs the
torch reference; the load step logged which and why. Activation-order layers whose groups
sort into runs were reordered at load, and their activations are gathered by the layer."""

from __future__ import annotations

import torch
import torch_npu

from tandem.core.kernels.npu.layouts import NpuInt4Weight
from tandem.core.kernels.reference import int4_linear as reference


def _bias(bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    # The op adds a float32 bias to bfloat16 activations, a float16 one to float16.
    if bias is None:
        return None
    return bias.to(torch.float32 if dtype is torch.bfloat16 else dtype).contiguous()


def int4_linear(
    x: torch.Tensor,
    codes: torch.Tensor | NpuInt4Weight,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``x`` [..., K] float16/bfloat16 -> [..., N] in ``x``'s dtype; ``codes`` the op's
    layout, or the CPU layout (with ``scales``, ``zeros``, ``g_idx``) for the reference."""
    if not isinstance(codes, NpuInt4Weight):
        return reference.int4_linear(x, codes, scales, zeros, g_idx, bias)
    lead, rows = x.shape[:-1], x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:  # the op refuses empty tensors
        return x.new_empty(*lead, codes.outputs)
    out: torch.Tensor = torch_npu.npu_weight_quant_batchmatmul(
        rows,
        codes.packed,
        codes.scale,
        codes.offset,
        bias=_bias(bias, x.dtype),
        antiquant_group_size=codes.group_size,
    )
    return out.reshape(*lead, codes.outputs)
