"""Gated DeltaNet over the tokens of sequences verifying drafts, position by position: each
position's tokens go through the decode step (``step``: the device's conv update or one-step
delta rule, handed in by the layer) and the states of the sequences with a later token are
copied into their scratch rows, to roll back to. What runs wherever no kernel takes a
sequence's positions in one call (the CPU's does, ``cpu/linear_attention.py``); on CUDA and
Ascend ``step`` is then the Triton decode kernel.

The tokens arrive sequence by sequence (the step's order) and leave so; each position's run
is gathered once (``LinearVerifyIndices.order``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.core.kernels.linear_attention_metadata import (
    LinearAttentionMetadata,
    LinearVerifyIndices,
    LinearVerifyPosition,
)

# (x, weight, conv_states, meta, activation) -> the conv's decode step.
ConvStep = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, LinearAttentionMetadata, str], torch.Tensor
]
# (q, k, v, g, beta, states, meta) -> the delta rule's decode step.
DeltaStep = Callable[..., torch.Tensor]


def conv_verify(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    verify: LinearVerifyIndices,
    activation: str,
    step: ConvStep,
) -> torch.Tensor:
    def position(p: LinearVerifyPosition, xs: list[torch.Tensor]) -> torch.Tensor:
        y = step(xs[0], weight, conv_states, p.meta, activation)
        _keep(conv_states, p)
        return y

    return _by_position(verify, [x], position)


def delta_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    verify: LinearVerifyIndices,
    step: DeltaStep,
) -> torch.Tensor:
    def position(p: LinearVerifyPosition, xs: list[torch.Tensor]) -> torch.Tensor:
        y: torch.Tensor = step(*xs, states, p.meta)
        _keep(states, p)
        return y

    return _by_position(verify, [q, k, v, g, beta], position)


def _by_position(
    verify: LinearVerifyIndices,
    inputs: list[torch.Tensor],
    step: Callable[[LinearVerifyPosition, list[torch.Tensor]], torch.Tensor],
) -> torch.Tensor:
    """``step`` on each position's run of ``inputs`` (the verify part's rows, gathered in
    position order once), the outputs put back in token order once."""
    gathered = [x.index_select(0, verify.order) for x in inputs]
    outs, start = [], 0
    for p in verify.positions:
        end = start + p.meta.num_decodes
        outs.append(step(p, [x[start:end] for x in gathered]))
        start = end
    joined = torch.cat(outs)
    out = torch.empty_like(joined)
    out.index_copy_(0, verify.order, joined)
    return out


def _keep(pool: torch.Tensor, p: LinearVerifyPosition) -> None:
    """Copy the state rows of ``p``'s sequences with a later token to their scratch rows
    (sources and destinations disjoint)."""
    if p.num_saved:
        pool.index_copy_(0, p.save_to, pool.index_select(0, p.save_from))
