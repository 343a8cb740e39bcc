"""Per-sequence state pools of a model's linear-attention layers: sizing and allocation.

Each layer gets its own conv-state and recurrent-state pool with ``num_slots + 1`` rows (row 0
is the null slot). Sizing goes with the KV blocks: ``state_bytes_per_slot`` over all layers
is what one running sequence costs, whatever its length.
"""

from __future__ import annotations

import torch

from tandem.core.layers.gated_delta_net import RECURRENT_STATE_DTYPE, GatedDeltaNet


def state_bytes_per_slot(layers: list[GatedDeltaNet], dtype: torch.dtype) -> int:
    """Bytes one state slot takes across ``layers`` on this rank (``dtype``: the model's)."""
    return sum(layer.state_bytes_per_slot(dtype) for layer in layers)


def allocate_linear_attention_state(
    layers: list[GatedDeltaNet], num_slots: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Allocate and bind every layer's pools; returns them per layer (conv, recurrent).

    Zeroed, so that a slot never holds NaN (kernels select, never multiply, the state of a
    sequence's first chunk away, but a zeroed pool is cheap insurance for the null slot)."""
    pools: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer in layers:
        conv = torch.zeros(layer.conv_state_shape(num_slots), dtype=dtype, device=device)
        recurrent = torch.zeros(
            layer.recurrent_state_shape(num_slots), dtype=RECURRENT_STATE_DTYPE, device=device
        )
        layer.bind_state(conv, recurrent)
        pools.append((conv, recurrent))
    return pools
