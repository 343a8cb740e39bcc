"""The W8A8 linear through torch_npu's ops, as vllm-ascend's ``w8a8_dynamic.py`` chains them:
activations to int8 per token (``npu_dynamic_quant``) or with the calibrated per-tensor scale
(``npu_quantize``), then ``npu_quant_matmul``'s exact int32 product scaled per channel and
per token into the model's dtype. The weight is the checkpoint's [N, K], read as its
transposed view; its scale the (N,) float32 made at load (``layouts.int8_scale_layout``).

The static scale rides as the per-token scale of every row rather than folded into the
weight scale (vllm-ascend's ``deq_scale``): the product is then scaled by the same two
factors as the torch reference's, not by their rounded product. Row-parallel layers sum the
exact int32 products across ranks before scaling (``layers/quantized_linear.py``):
``int8_matmul`` is the op's int32 output, where it applies no scale. The ops take float16
and bfloat16 activations only (``npu_dynamic_quant``'s page), so ``loading`` offers
these kernels for those dtypes.
"""

from __future__ import annotations

from functools import cache

import torch
import torch_npu

from tandem.core.kernels.reference.int8_linear import per_token_scale


@cache
def _unit_scale(device: torch.device) -> torch.Tensor:
    """The scale an int32 output requires and ignores; one per device, made once."""
    return torch.ones(1, dtype=torch.float32, device=device)


def _bias(bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    # A float16 output takes an int32, bfloat16 or float32 bias, not a float16 one.
    if bias is None or dtype is not torch.float16:
        return bias
    return bias.float()


def int8_quantize(
    x: torch.Tensor, scale: torch.Tensor | None, absmax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] -> (int8 [M, K], float32 scale [M, 1] or [1, 1]), as the reference."""
    if scale is not None:
        s = scale.float().reshape(1)
        q = torch_npu.npu_quantize(x, s, None, torch.qint8, axis=-1, div_mode=True)
        return q, s.reshape(1, 1)
    if absmax is None:
        q, token_scale = torch_npu.npu_dynamic_quant(x)
        return q, token_scale.unsqueeze(-1)
    # Every rank's columns of a token share its scale: quantize each row by it.
    s = per_token_scale(absmax)
    q = torch_npu.npu_quantize(x, s.reshape(-1), None, torch.qint8, axis=0, div_mode=True)
    return q, s


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a`` int8 [M, K] times ``b`` int8 [N, K] transposed -> exact int32 [M, N]."""
    out: torch.Tensor = torch_npu.npu_quant_matmul(
        a, b.t(), _unit_scale(a.device), output_dtype=torch.int32
    )
    return out


def int8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``x`` [..., K] float16/bfloat16, ``weight`` int8 [N, K], ``weight_scale`` (N,) float32
    -> [..., N] in ``x``'s dtype."""
    lead, rows = x.shape[:-1], x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:  # the ops refuse empty tensors
        return x.new_empty(*lead, weight.shape[0])
    q, scale = int8_quantize(rows, input_scale)
    out: torch.Tensor = torch_npu.npu_quant_matmul(
        q,
        weight.t(),
        weight_scale.reshape(-1),
        pertoken_scale=scale.reshape(-1).expand(rows.shape[0]).contiguous(),
        bias=_bias(bias, x.dtype),
        output_dtype=x.dtype,
    )
    return out.reshape(*lead, weight.shape[0])
