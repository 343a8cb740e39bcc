"""RMSNorm with its weight; the arithmetic is the registry-resolved ``rms_norm`` kernel."""

from __future__ import annotations

import torch
from torch import nn

from tandem.core.layers.kernels import KernelHandle, rms_norm
from tandem.core.layers.weights import LazyTensor, copy_checked, read_shard


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self._kernel = KernelHandle("rms_norm", rms_norm)

    def load_weight(self, param: nn.Parameter, loaded: LazyTensor, name: str) -> None:
        copy_checked(param.data, read_shard(loaded, 0, 0, param.shape[0]), name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernel(x, self.weight, self.eps)
