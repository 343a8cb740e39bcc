"""Rotary position embedding (rotate-half layout) with the cos/sin table built once.

One table serves every layer of a model (at a real ``max_position_embeddings`` a table per
layer would cost hundreds of MB): layers take it whole (the fused q/k-norm + rotary kernel
indexes it by position), or the step's rows looked up once per forward (``lookup``) and
applied per layer (``rotate``)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tandem.core.kernels import handles

ROPE_TYPES = ("default", "linear", "llama3")


def _inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (theta**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_inv_freq(rotary_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = _inv_freq(rotary_dim, theta)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default" or scaling is None:
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")


class RotaryEmbedding(nn.Module):
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
    ):
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.theta = theta
        self.scaling = scaling
        self._kernel = handles.rotary()
        self.register_buffer("cos", torch.empty(max_position, head_dim // 2, dtype=dtype), False)
        self.register_buffer("sin", torch.empty(max_position, head_dim // 2, dtype=dtype), False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the tables; called again after a model is materialised from meta."""
        if self.cos.is_meta:
            return
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        positions = torch.arange(self.max_position, device=self.cos.device).float()
        freqs = torch.outer(positions, inv_freq.to(positions.device))
        # Rounded to the model dtype, as transformers rounds them before rotating.
        self.cos.copy_(freqs.cos())
        self.sin.copy_(freqs.sin())

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at ``positions`` [T], each [T, 1, head_dim / 2]."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [T, H, D] with rows from ``lookup``."""
        return self._kernel(x, cos, sin)
