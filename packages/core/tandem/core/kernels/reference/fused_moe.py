"""The torch reference of the routed experts: the (token, choice) pairs sorted by expert,
each active expert's two GEMMs on its contiguous rows, the rows scaled by their routing
weights and added back to their tokens in expert order. Python loops over active experts
only, never over tokens."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from tandem.core.kernels.reference.elementwise import GATED_ACTIVATIONS

# One active expert's rows of the sorted routing: (expert, first row, end row).
Span = tuple[int, int, int]


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """``x`` [T, H], ``topk_weights``/``topk_ids`` [T, k] -> [T, H]: sum over each token's k
    experts of weight * down(act(gate(x)) * up(x))."""
    act = GATED_ACTIVATIONS[activation]
    order, token, offsets = sort_rows(topk_ids, w13.shape[0])
    counts = offsets.diff()
    active = counts.nonzero().squeeze(1)
    rows = x.index_select(0, token)
    out = torch.empty_like(rows)
    start = 0
    for expert, count in zip(active.tolist(), counts[active].tolist(), strict=True):
        end = start + count
        hidden = act(F.linear(rows[start:end], w13[expert]))
        torch.matmul(hidden, w2[expert].t(), out=out[start:end])
        start = end
    return combine(x, out, order, token, topk_weights)


def sort_rows(
    topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routing's (token, choice) pairs sorted by expert: the order (indices into the
    flattened ``topk_ids``), each sorted row's token, and where each expert's rows start
    and end, ``offsets`` [E + 1] int64 (expert e's rows are ``offsets[e]`` to
    ``offsets[e + 1]``), all where the routing lies: nothing is read on the host."""
    num_choices = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # stable: a token's experts stay in id order
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    torch.cumsum(torch.bincount(flat, minlength=num_experts), 0, out=offsets[1:])
    return order, order // num_choices, offsets


def spans_of(offsets: torch.Tensor) -> list[Span]:
    """Each active expert's rows, read on the host from ``sort_rows``' offsets."""
    bounds = offsets.tolist()
    return [
        (e, start, end) for e, (start, end) in enumerate(itertools.pairwise(bounds)) if end > start
    ]


def combine(
    x: torch.Tensor,
    out: torch.Tensor,
    order: torch.Tensor,
    token: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """The sorted rows ``out`` scaled by their routing weights and summed back onto their
    tokens, in expert order (the float reference's sum)."""
    out.mul_(topk_weights.reshape(-1)[order].unsqueeze(1).to(out.dtype))
    return torch.zeros(x.shape[0], out.shape[1], dtype=x.dtype, device=x.device).index_add_(
        0, token, out
    )


def topk_softmax(
    logits: torch.Tensor, top_k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice: softmax over ``logits`` [T, E] in float32, the ``top_k`` largest,
    optionally renormalised to sum to one, rounded to the logits' dtype; and their expert ids
    (int64), each [T, top_k]."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids
