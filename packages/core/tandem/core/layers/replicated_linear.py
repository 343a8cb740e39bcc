"""A small linear layer every rank holds whole (MoE router, shared-expert gate)."""

from __future__ import annotations

import torch
from torch import nn

from tandem.core.kernels.cpu.packed_linear import PackableLinear
from tandem.core.layers.weights import LazyTensor, copy_checked


class ReplicatedLinear(PackableLinear):
    # A few outputs (8 to 512 experts, one gate) padded to the native kernel's panels: on
    # oneDNN a 512 x 8 router took ~80 us a call in the engine, 16 us on our kernel. Its
    # consumers (the top-k, the gate's sigmoid) take the strided view ``matmul`` returns.
    pad_outputs = True

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def load_weight(self, param: nn.Parameter, loaded: LazyTensor, name: str) -> None:
        copy_checked(param.data, loaded[:, :], name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)
