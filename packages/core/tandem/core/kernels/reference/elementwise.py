"""The torch references of the elementwise kernels (RMSNorm and its variants, gated
activations, rotary): what runs on a device without its own implementation, and what every
other implementation is tested against."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

KernelFn = Callable[..., torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32, scale in the input dtype (as Llama and Qwen define it)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm_gated(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``x`` and ``gate`` [N, D] -> [N, D]. Roundings as the reference: the normalised value
    is rounded to the input dtype before the weight, the gate product is taken in float32."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(x.dtype)
    return (h * F.silu(gate.float())).to(x.dtype)


def rms_norm_zero_centered(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Unlike Llama's RMSNorm, the scale multiplies before rounding: (x * w).to(dtype).
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


def _gated(act: Callable[[torch.Tensor], torch.Tensor]) -> KernelFn:
    def kernel(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return act(gate) * up

    return kernel


GATED_ACTIVATIONS: dict[str, KernelFn] = {
    "silu": _gated(F.silu),
    "gelu": _gated(F.gelu),
    "gelu_pytorch_tanh": _gated(lambda t: F.gelu(t, approximate="tanh")),
}


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of ``x`` [T, H, D] with cos/sin [T, 1, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): a layer's residual add and the norm after it."""
    h = x + residual
    return rms_norm(h, weight, eps), h


def add_rms_norm_zero_centered(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm`` with the zero-centred norm (Qwen3.5's)."""
    h = x + residual
    return rms_norm_zero_centered(h, weight, eps), h


def qk_norm_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    zero_centered: bool = False,
    rotary_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q/k RMSNorm per head (Qwen3; skipped without weights; ``zero_centered``: Qwen3.5's,
    scaled by ``1 + weight``), then rotary of the first ``rotary_dim`` dims (default all;
    fewer with partial rotary, the rest passing through) at ``positions`` through the
    [max_position, rotary_dim / 2] tables."""
    if q_weight is not None and k_weight is not None:
        norm = rms_norm_zero_centered if zero_centered else rms_norm
        q, k = norm(q, q_weight, eps), norm(k, k_weight, eps)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    if rotary_dim is None or rotary_dim == q.shape[-1]:
        return rotary(q, c, s), rotary(k, c, s)
    return partial_rotary(q, c, s, rotary_dim), partial_rotary(k, c, s, rotary_dim)


def partial_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int
) -> torch.Tensor:
    """``rotary`` of the first ``rotary_dim`` dims of ``x``, the rest as they are."""
    return torch.cat((rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
