"""Gated activation: ``npu_swiglu``."""

from __future__ import annotations

import torch

from ._rules import FLOATS, require, require_contiguous, require_dtype, require_rank

_OP = "npu_swiglu"
_DOC = (
    "torch_npu.npu_swiglu, op-plugin docs/zh/custom_APIs/torch_npu/（beta）torch_npu-npu_swiglu.md;"
    " schema op_plugin/config/op_plugin_functions.yaml"
)


def npu_swiglu(self: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``swish(A) * B = A * sigmoid(A) * B`` where A is the FIRST half of ``input`` along
    ``dim`` and B the second half (the gate is the first half).

    Schema: ``npu_swiglu(Tensor self, int dim=-1) -> Tensor`` (documented as ``input``; the
    binding's first argument is ``self``). Rules (op-plugin page):

    - 1 to 8 dims, float32 / float16 / bfloat16, contiguous, not empty; the size along
      ``dim`` divisible by 2; ``dim`` in [-input.dim(), input.dim() - 1].
    - Output: the input's dtype, half the size along ``dim``. Computed in float32, rounded
      once.
    """
    x = self
    require_rank(_OP, "input", x, range(1, 9), _DOC)
    require_dtype(_OP, "input", x, FLOATS, _DOC)
    require_contiguous(_OP, "input", x, _DOC)
    require(x.numel() > 0, _OP, "input must not be empty", _DOC)
    require(
        -x.dim() <= dim <= x.dim() - 1,
        _OP,
        f"dim must be in [{-x.dim()}, {x.dim() - 1}], got {dim}",
        _DOC,
    )
    require(
        x.shape[dim] % 2 == 0,
        _OP,
        f"the size along dim must be divisible by 2, got {x.shape[dim]}",
        _DOC,
    )
    a, b = x.float().chunk(2, dim=dim)
    return (a * torch.sigmoid(a) * b).to(x.dtype)
