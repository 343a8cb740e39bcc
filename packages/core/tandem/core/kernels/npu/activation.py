"""SiLU-gated activation through ``torch_npu.npu_swiglu``: silu of the first half of the last
dim times the second, which is the [gate | up] layout of the merged projection."""

from __future__ import annotations

import torch
import torch_npu


def gated_silu(gate_up: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = torch_npu.npu_swiglu(gate_up, dim=-1)
    return out
