"""RMSNorm as Llama and Qwen define it: normalise in float32, scale in the input dtype."""

from __future__ import annotations

import torch
from torch import nn

from tandem.core.layers.weights import LazyTensor, copy_checked, read_shard


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def load_weight(self, param: nn.Parameter, loaded: LazyTensor, name: str) -> None:
        copy_checked(param.data, read_shard(loaded, 0, 0, param.shape[0]), name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
