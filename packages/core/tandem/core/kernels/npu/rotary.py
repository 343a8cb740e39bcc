"""Rotary embedding through ``torch_npu.npu_rotary_mul`` (rotate-half mode, ``x * cos +
rotate(x) * sin`` with cos/sin over the whole head dim), and Qwen3's per-head q/k RMSNorm
before it through ``npu_rms_norm``. The model's tables hold half the head dim (each value
serves both halves), so they are widened per call on the step's positions only."""

from __future__ import annotations

import torch
import torch_npu


def _whole(half: torch.Tensor) -> torch.Tensor:
    return torch.cat((half, half), dim=-1)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [T, H, D], cos/sin [T, 1, D/2]."""
    out: torch.Tensor = torch_npu.npu_rotary_mul(x, _whole(cos), _whole(sin), rotary_mode="half")
    return out


def qk_norm_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    if q_weight is not None and k_weight is not None:
        q = torch_npu.npu_rms_norm(q, q_weight, epsilon=eps)[0]
        k = torch_npu.npu_rms_norm(k, k_weight, epsilon=eps)[0]
    c = _whole(cos[positions]).unsqueeze(1).to(q.dtype)
    s = _whole(sin[positions]).unsqueeze(1).to(q.dtype)
    q = torch_npu.npu_rotary_mul(q, c, s, rotary_mode="half")
    k = torch_npu.npu_rotary_mul(k, c, s, rotary_mode="half")
    return q, k
