"""Logprobs of the prompt's own tokens (completions' echo + logprobs, vLLM's prompt_logprobs).

The logits of every scored position are needed, not just the last one's, so they are computed
in chunks of rows: a long prompt never holds [prompt length, vocab] floats at once. Every rank
computes the logits (with tensor parallelism they are gathered across ranks, a collective each
rank must join), only the sampling rank keeps the result.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.core.llm.forward_input import PromptLogprobs, PromptLogprobsRequest

# Rows of logits alive at once.
CHUNK_ROWS = 512


def score_prompt(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    request: PromptLogprobsRequest,
    keep: bool,
) -> PromptLogprobs | None:
    """The logprob, rank and top candidates of each target of ``request``; None where
    ``keep`` is false (a rank that does not sample joins the collectives only)."""
    logprobs: list[float] = []
    ranks: list[int] = []
    top_ids: list[list[int]] = []
    top_values: list[list[float]] = []
    device = hidden.device
    total = int(request.token_indices.numel())
    for start in range(0, total, CHUNK_ROWS):
        rows = request.token_indices[start : start + CHUNK_ROWS].to(device)
        scores = compute_logits(hidden[rows]).float().log_softmax(dim=-1)
        if not keep:
            continue
        targets = request.target_ids[start : start + CHUNK_ROWS].to(device)
        chosen = scores.gather(1, targets.unsqueeze(1)).squeeze(1)
        rank = (scores > chosen.unsqueeze(1)).sum(dim=-1) + 1
        values, ids = scores.topk(max(request.num_top, 1), dim=-1)
        logprobs += chosen.tolist()
        ranks += rank.tolist()
        top_ids += ids.tolist()
        top_values += values.tolist()
    if not keep:
        return None
    return PromptLogprobs(logprobs, ranks, top_ids, top_values, request.spans)
