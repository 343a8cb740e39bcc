"""The MoE router's choice in Triton (``reference/fused_moe.py``, ``topk_softmax``): per token,
the softmax of its router logits in float32, the ``top_k`` largest probabilities and their
expert ids, optionally renormalised to sum to one, rounded to the logits' dtype. One launch
in place of the reference's four or five ops (softmax, topk, sum, divide, cast), each a launch
of its own on an accelerator, for every MoE layer of every decode step.

A program per tile of ``ROWS`` tokens, every expert of a token in one tile row (a power of two
at least E; past E masked). The top k are found by k rounds of max and argmax over the row,
each round striking out the expert it took: k is at most a few (2 to 10 in the checkpoints
served), and a sort of the whole row would cost more than k reductions.

Rounding: the softmax is torch's on CUDA (``exp(x - max) / sum``, in float32; torch's CPU
kernel multiplies by the reciprocal of the sum instead, an ulp apart); the renormalising sum
adds the k weights in the order they were taken. Ties between equal probabilities go to the
lower expert id (``torch.topk`` leaves their order unspecified).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tokens per program: a decode step's batch in one or a few programs.
ROWS = 16


@triton.jit
def _topk_softmax(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    tokens,
    experts,
    logits_stride,
    TOP_K: tl.constexpr,
    NORMALIZE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_E)
    row_mask = rows < tokens
    mask = row_mask[:, None] & (cols[None, :] < experts)
    x = tl.load(
        logits_ptr + rows[:, None] * logits_stride + cols[None, :], mask=mask, other=float("-inf")
    ).to(tl.float32)
    # Rows past the tokens would be all -inf (0 / 0 below): zeros instead, never stored.
    x = tl.where(row_mask[:, None], x, 0.0)
    top = tl.max(x, axis=1)
    e = tl.exp(x - top[:, None])
    probs = e / tl.sum(e, axis=1)[:, None]
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
    ids = tl.zeros((ROWS, BLOCK_K), dtype=tl.int64)
    total = tl.zeros((ROWS,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        best = tl.max(probs, axis=1)
        # The lowest expert id among those at the maximum: never a masked column (0 there,
        # at ids past E), since k <= E leaves a valid expert at 0 or above.
        at = tl.min(tl.where(probs == best[:, None], cols[None, :], BLOCK_E), axis=1)
        weights = tl.where(slots[None, :] == k, best[:, None], weights)
        ids = tl.where(slots[None, :] == k, at[:, None].to(tl.int64), ids)
        total += best
        probs = tl.where(cols[None, :] == at[:, None], -1.0, probs)
    if NORMALIZE:
        weights = weights / total[:, None]
    out = rows[:, None] * TOP_K + slots[None, :]
    out_mask = row_mask[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + out, weights.to(weights_ptr.dtype.element_ty), mask=out_mask)
    tl.store(ids_ptr + out, ids, mask=out_mask)


def topk_softmax(
    logits: torch.Tensor, top_k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights [T, top_k] in the dtype of ``logits`` [T, E] (any token stride) and
    their expert ids (int64), largest first."""
    tokens, experts = logits.shape
    if not 0 < top_k <= experts:
        raise ValueError(f"top_k {top_k} must be in [1, {experts}]")
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    weights = torch.empty(tokens, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    if tokens:
        _topk_softmax[(triton.cdiv(tokens, ROWS),)](
            logits, weights, ids, tokens, experts, logits.stride(0),
            TOP_K=top_k, NORMALIZE=normalize, ROWS=ROWS,
            BLOCK_E=triton.next_power_of_2(experts), BLOCK_K=triton.next_power_of_2(top_k),
        )  # fmt: skip
    return weights, ids
