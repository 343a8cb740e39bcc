"""Gated activations over a fused [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")


def gated_activation(name: str, gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    if name == "silu":
        return F.silu(gate) * up
    if name == "gelu":
        return F.gelu(gate) * up
    if name == "gelu_pytorch_tanh":
        return F.gelu(gate, approximate="tanh") * up
    raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(ACTIVATIONS)}")
