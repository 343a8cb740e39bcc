"""Zero-centred RMSNorm (Qwen3.5): the weight is stored as an offset from one, so the scale is
``1 + weight``; normalised and scaled in float32, rounded once to the input dtype."""

from __future__ import annotations

import torch
from torch import nn

from tandem.core.kernels import handles
from tandem.core.layers.weights import LazyTensor, copy_checked, read_shard


class ZeroCenteredRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        self._kernel = handles.rms_norm_zero_centered()
        self._add_kernel = handles.add_rms_norm_zero_centered()

    def load_weight(self, param: nn.Parameter, loaded: LazyTensor, name: str) -> None:
        copy_checked(param.data, read_shard(loaded, 0, 0, param.shape[0]), name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernel(x, self.weight, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual). The residual tensor is handed over: the fused
        kernel writes the new sum into it."""
        return self._add_kernel(x, residual, self.weight, self.eps)
