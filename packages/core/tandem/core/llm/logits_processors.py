"""Everything the sampler does to the logits before temperature, in vLLM's order: the grammar's
allowed tokens, min_tokens' banned stop tokens and logit_bias, then the penalties. One batched
op each, over only the rows that use it; min_p (after temperature) is here too."""

from __future__ import annotations

import torch

from tandem.core.llm.forward_input import GrammarMasks, SamplingBatch, SparseLogitEdits
from tandem.core.llm.penalties import apply_penalties


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``logits`` [S, V] float32 with the batch's edits applied (a new tensor)."""
    logits = logits.clone()
    if batch.grammar is not None:
        apply_grammar_masks(logits, batch.grammar)
    if batch.logit_edits is not None:
        apply_sparse_edits(logits, batch.logit_edits)
    if batch.penalties is not None:
        apply_penalties(logits, batch.penalties)
    return logits


def apply_grammar_masks(logits: torch.Tensor, masks: GrammarMasks) -> None:
    """Set to -inf, in place, the logits of tokens a row's grammar does not allow."""
    device = logits.device
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (masks.bitmask.to(device).unsqueeze(-1) >> shifts) & 1
    allowed = bits.flatten(1)[:, :vocab].bool()
    rows = masks.rows.to(device)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_sparse_edits(logits: torch.Tensor, edits: SparseLogitEdits) -> None:
    device = logits.device
    logits.index_put_(
        (edits.rows.to(device), edits.tokens.to(device)),
        edits.values.to(device),
        accumulate=True,
    )


def apply_min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than ``min_p`` times the row's most likely token (after
    temperature); a row with min_p 0 keeps everything."""
    probs = scaled.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.to(scaled.device).unsqueeze(1)
    return scaled.masked_fill(probs < threshold, float("-inf"))
