"""Depthwise causal conv1d over the Gated DeltaNet's q/k/v channels, with a per-sequence state.

Each channel convolves its last ``K`` inputs with its own ``K`` taps, then SiLU. The conv state
of a sequence is its last ``K - 1`` inputs, ``[channels, K - 1]`` oldest first, kept in row
``slot`` of a ``[num_slots + 1, channels, K - 1]`` pool and updated in place. Products are
accumulated in float32 and rounded once, as ``F.conv1d`` does.
"""

from __future__ import annotations

import torch

from tandem.core.kernels.linear_attention_metadata import LinearAttentionMetadata

ACTIVATIONS = {"silu": torch.nn.functional.silu}


def check_activation(name: str) -> None:
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported linear-attention activation {name!r}; supported: silu")


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    meta: LinearAttentionMetadata,
    activation: str,
) -> torch.Tensor:
    """The prefill tokens ``x`` [N, C] (sequences contiguous) -> [N, C]; every prefill
    sequence's state slot is left holding its last K - 1 inputs."""
    p = meta.prefill
    assert p is not None
    channels = x.shape[1]
    initial = conv_states.index_select(0, p.state_slots)  # [B, C, K - 1]
    if not p.all_have_initial_state:
        initial = torch.where(p.has_initial_state.view(-1, 1, 1), initial, 0)
    initial = initial.to(x.dtype)
    source = torch.cat((x, initial.transpose(1, 2).reshape(-1, channels)))
    wide = source.float()
    w = weight.float()
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for tap in range(weight.shape[1]):  # K taps (4), each one batched gather over all tokens
        acc.addcmul_(wide.index_select(0, p.conv_window_index[tap]), w[:, tap])
    history = source[p.conv_state_index]  # [K - 1, B, C]
    conv_states.index_copy_(0, p.state_slots, history.permute(1, 2, 0).to(conv_states.dtype))
    return ACTIVATIONS[activation](acc.to(x.dtype))


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    meta: LinearAttentionMetadata,
    activation: str,
) -> torch.Tensor:
    """One new token per decode sequence: ``x`` [B, C] -> [B, C], states shifted by one."""
    slots = meta.decode_slots
    state = conv_states.index_select(0, slots)
    if not meta.decodes_have_initial_state:
        state = torch.where(meta.decode_has_initial_state.view(-1, 1, 1), state, 0)
    state = state.to(x.dtype)
    window = torch.cat((state, x.unsqueeze(-1)), dim=-1)  # [B, C, K]
    out = (window.float() * weight.float()).sum(-1)
    conv_states.index_copy_(0, slots, window[..., 1:].to(conv_states.dtype))
    return ACTIVATIONS[activation](out.to(x.dtype))
