"""Gated RMSNorm of the Gated DeltaNet output (Qwen3.5's ``RMSNormGated``): normalise each
value head, scale by the weight, multiply by ``silu(gate)``."""

from __future__ import annotations

import torch
from torch import nn

from tandem.core.kernels import handles
from tandem.core.layers.weights import LazyTensor, copy_checked, read_shard


class GatedRMSNorm(nn.Module):
    def __init__(self, head_dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(head_dim), requires_grad=False)
        self._kernel = handles.rms_norm_gated()

    def load_weight(self, param: nn.Parameter, loaded: LazyTensor, name: str) -> None:
        copy_checked(param.data, read_shard(loaded, 0, 0, param.shape[0]), name)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self._kernel(x, gate, self.weight, self.eps)
