"""RMSNorm and the residual add before it through ``torch_npu.npu_rms_norm`` /
``npu_add_rms_norm`` (each returns the normalised tensor and the float32 rstd; the add also
the sum, which becomes the new residual)."""

from __future__ import annotations

import torch
import torch_npu


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    y, _ = torch_npu.npu_rms_norm(x, weight, epsilon=eps)
    out: torch.Tensor = y
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    y, _, summed = torch_npu.npu_add_rms_norm(x, residual, weight, epsilon=eps)
    return y, summed
