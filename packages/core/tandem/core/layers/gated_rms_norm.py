"""Gated RMSNorm of the Gated DeltaNet output (Qwen3.5's ``RMSNormGated``): normalise each
value head, scale by the weight, multiply by ``silu(gate)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.core.layers.kernels import KernelHandle
from tandem.core.layers.weights import LazyTensor, copy_checked, read_shard


def rms_norm_gated(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``x`` and ``gate`` [N, D] -> [N, D]. Roundings as the reference: the normalised value
    is rounded to the input dtype before the weight, the gate product is taken in float32."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(x.dtype)
    return (h * F.silu(gate.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    def __init__(self, head_dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(head_dim), requires_grad=False)
        self._kernel = KernelHandle("rms_norm_gated", rms_norm_gated)

    def load_weight(self, param: nn.Parameter, loaded: LazyTensor, name: str) -> None:
        copy_checked(param.data, read_shard(loaded, 0, 0, param.shape[0]), name)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self._kernel(x, gate, self.weight, self.eps)
