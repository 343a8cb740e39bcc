"""Rotary embedding through ``torch_npu.npu_rotary_mul`` (rotate-half mode, ``x * cos +
rotate(x) * sin`` with cos/sin over the whole head dim), and Qwen3's per-head q/k RMSNorm
(or Qwen3.5's zero-centred one, with partial rotary) before it through ``npu_rms_norm``. The
model's tables hold half the rotated dims (each value serves both halves), so they are widened
per call on the step's positions only."""

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
    zero_centered: bool = False,
    rotary_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's ``qk_norm_rotary`` into new tensors. Zero-centred (Qwen3.5): the
    scale ``1 + weight`` in float32 as gamma, which ``npu_rms_norm`` takes beside a half
    precision input and applies before its one rounding, as the reference rounds. Partial
    rotary: the first ``rotary_dim`` dims through ``npu_rotary_mul``, the rest appended."""
    if q_weight is not None and k_weight is not None:
        if zero_centered:
            q_weight, k_weight = 1.0 + q_weight.float(), 1.0 + k_weight.float()
        q = torch_npu.npu_rms_norm(q, q_weight, epsilon=eps)[0]
        k = torch_npu.npu_rms_norm(k, k_weight, epsilon=eps)[0]
    c = _whole(cos[positions]).unsqueeze(1).to(q.dtype)
    s = _whole(sin[positions]).unsqueeze(1).to(q.dtype)
    if rotary_dim is None or rotary_dim == q.shape[-1]:
        q = torch_npu.npu_rotary_mul(q, c, s, rotary_mode="half")
        k = torch_npu.npu_rotary_mul(k, c, s, rotary_mode="half")
        return q, k
    return _partial(q, c, s, rotary_dim), _partial(k, c, s, rotary_dim)


def _partial(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    rotated = torch_npu.npu_rotary_mul(x[..., :rotary_dim], c, s, rotary_mode="half")
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
