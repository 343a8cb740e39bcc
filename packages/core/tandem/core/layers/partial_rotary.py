"""Rotary embedding over the first ``rotary_dim`` dims of each head (partial rotary, as
Qwen3.5's ``partial_rotary_factor``); the rest of the head passes through unrotated. The table
covers the rotated dims only; ``GatedAttention`` applies it with the fused q/k norm + rotary
kernel (``handles.qk_norm_rotary`` with ``rotary_dim``), in place.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.core.layers.rotary import RotaryEmbedding


class PartialRotaryEmbedding(RotaryEmbedding):
    def __init__(
        self,
        rotary_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
    ):
        if rotary_dim <= 0 or rotary_dim % 2:
            raise ValueError(f"the rotary dimension ({rotary_dim}) must be even and positive")
        super().__init__(rotary_dim, max_position, theta, scaling, dtype)
        self.rotary_dim = rotary_dim
