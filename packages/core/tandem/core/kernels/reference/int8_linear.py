"""The torch reference of the int8 linear (W8A8): activations quantized to int8 (per token
from their own absmax, or with a calibrated per-tensor scale), an exact int32 product with
int8 weights, then dequantized with the activation and per-channel weight scales.

What every faster int8 kernel (VNNI, AMX, NPU) is tested against. Roundings as vLLM's
``scaled_int8_quant``: the scale is float32, values are divided by it, rounded half to even
and saturated to int8.
"""

from __future__ import annotations

import functools
import os

import torch

from tandem.device.cpu import cpu_flags

# Per-token scales put each token's largest magnitude at 127, so dynamic values never saturate;
# a static scale was calibrated on other inputs, so its values are clamped to int8's range.
_DYNAMIC_MAX = 127.0
_INT8_MIN, _INT8_MAX = -128, 127
# oneDNN's int8 GEMM (torch._int_mm on CPU) is exact only with VNNI or AMX-INT8 dot products.
# Without them it multiplies with vpmaddubsw, whose int16 pair sums saturate once the codes
# pass 7 bits: measured under ONEDNN_MAX_CPU_ISA=AVX2 (what an AVX2-only CPU runs), 16383 of
# 16384 sums of full-range codes [32, 1024] x [1024, 512] were wrong, by up to 153883.
_EXACT_INT_MM_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})
_INEXACT_ONEDNN_CAPS = frozenset({"SSE41", "AVX", "AVX2", "AVX512_CORE"})


def per_token_scale(absmax: torch.Tensor) -> torch.Tensor:
    """The dynamic scale of tokens whose largest magnitude is ``absmax`` [M, 1] (float32)."""
    scale = absmax.float() / _DYNAMIC_MAX
    # An all-zero token quantizes to zeros whatever its scale; 1 keeps the division finite.
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def quantize_int8(
    x: torch.Tensor, scale: torch.Tensor | None, absmax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] -> (int8 [M, K], float32 scale [M, 1] or [1, 1]) with x ~ q * scale.
    ``scale``: the static one, or None for per-token scales from each token's ``absmax``
    [M, 1] (given where ``x`` is one rank's columns of the tokens; else taken from ``x``)."""
    h = x.float()
    if scale is not None:
        s = scale.float().reshape(1, 1)
    else:
        s = per_token_scale(h.abs().amax(dim=-1, keepdim=True) if absmax is None else absmax)
    # torch.round rounds half to even, as the CUDA and CPU kernels of vLLM do.
    q = torch.round(h / s).clamp_(_INT8_MIN, _INT8_MAX).to(torch.int8)
    return q, s


@functools.cache
def _cpu_int_mm_is_exact() -> bool:
    """Whether oneDNN multiplies int8 with VNNI or AMX here (decided once per process)."""
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper() in _INEXACT_ONEDNN_CAPS:
        return False
    return bool(_EXACT_INT_MM_FLAGS & cpu_flags())


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a`` int8 [M, K] times ``b`` int8 [N, K] transposed -> int32 [M, N], exact (|sum| <=
    K * 128 * 128 fits int32 for K < 131072)."""
    if hasattr(torch, "_int_mm") and (a.device.type != "cpu" or _cpu_int_mm_is_exact()):
        out: torch.Tensor = torch._int_mm(a, b.t())
        return out
    # int64 products and sums are exact; the result fits int32 by the bound above.
    return (a.long() @ b.long().t()).to(torch.int32)


def dequantize(
    acc: torch.Tensor,
    scale: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """int32 sums [M, N] -> ``dtype``: times the activation scale [M, 1] or [1, 1] and the
    per-channel weight scale [N, 1], plus the bias, in float32."""
    out = acc.float() * scale * weight_scale.float().reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(dtype)


def int8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``x`` [..., K] float, ``weight`` int8 [N, K], ``weight_scale`` [N, 1] -> [..., N] in
    ``x``'s dtype. ``input_scale``: the static per-tensor scale (a scalar tensor), or None to
    quantize each token with its own."""
    lead = x.shape[:-1]
    q, scale = quantize_int8(x.reshape(-1, x.shape[-1]), input_scale)
    out = dequantize(int8_matmul(q, weight), scale, weight_scale, bias, x.dtype)
    return out.reshape(*lead, weight.shape[0])
