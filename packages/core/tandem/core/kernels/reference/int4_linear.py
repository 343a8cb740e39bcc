"""The torch reference of the 4-bit weight-only linear (W4A16, GPTQ): the weight dequantized on
the fly, ``(code - zero) * scale``, then one float matmul in the activations' dtype.

The weight arrives in the layout the layer packs once at load (``layers/int4_weights.py``):
codes int32 [N, K / 8], eight inputs of one output per word (the nibble order of
``int4_packing``), so that the dequantized weight is the row-major [N, K] ``F.linear`` takes;
``scales`` [N, G] and ``zeros`` (uint8, the true zero points) [N, G]. Inputs are in groups of
K / G consecutive columns, or, for a layer quantized in activation order, input k is in group
``g_idx[k]``.

``code - zero`` is a small exact integer, so each dequantized weight is one rounding of its
exact value: the same float a dequantize-then-float checkpoint holds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.core.kernels.reference.int4_packing import unpack_int4


def dequantize_int4(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The float weight [N, K] in ``dtype`` of packed ``codes`` [N, K / 8]."""
    q = unpack_int4(codes, dim=1).to(dtype)
    rows, groups = scales.shape
    s, z = scales.to(dtype), zeros.to(dtype)
    if g_idx is None:
        w = (q.view(rows, groups, -1) - z.unsqueeze(-1)) * s.unsqueeze(-1)
        return w.view(rows, -1)
    return (q - z[:, g_idx]) * s[:, g_idx]


def int4_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``x`` [..., K] float times the dequantized weight transposed (+ ``bias``) -> [..., N]
    in ``x``'s dtype."""
    return F.linear(x, dequantize_int4(codes, scales, zeros, g_idx, x.dtype), bias)
