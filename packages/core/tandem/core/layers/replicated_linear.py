"""A small linear layer every rank holds whole (MoE router, shared-expert gate)."""

from __future__ import annotations

import torch
from torch import nn

from tandem.core.kernels.cpu.packed_linear import PackableLinear
from tandem.core.layers.weights import LazyTensor, copy_checked


class ReplicatedLinear(PackableLinear):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def load_weight(self, param: nn.Parameter, loaded: LazyTensor, name: str) -> None:
        copy_checked(param.data, loaded[:, :], name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)
