"""Repetition, frequency and presence penalties, batched.

Definitions follow vLLM (and, for repetition, transformers' RepetitionPenaltyLogitsProcessor):
a token seen in the prompt or the output has its logit divided by ``repetition_penalty`` when
positive and multiplied when negative; a token generated ``c`` times loses
``frequency_penalty * c + presence_penalty * (c > 0)`` (the output only, not the prompt).

The batch reads each sequence's tokens from its ``TokenHistory`` (``token_history.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.core.llm.forward_input import PenaltyBatch
from tandem.core.llm.sequence import TokenSequence
from tandem.core.llm.token_history import TokenHistory


def build_penalty_batch(rows: list[int], seqs: Sequence[TokenSequence]) -> PenaltyBatch:
    """The penalties of ``seqs``, which sample at sampling rows ``rows``."""
    outputs, prompts = [], []
    for seq in seqs:
        if seq.token_history is None:
            seq.token_history = TokenHistory(seq.prompt_token_ids)
        outputs.append(seq.token_history.output(seq.output_token_ids))
        # Only the repetition penalty looks at the prompt.
        no_prompt = seq.params.repetition_penalty == 1.0
        prompts.append(seq.token_history.prompt[:0] if no_prompt else seq.token_history.prompt)
    index = torch.arange(len(seqs))
    return PenaltyBatch(
        rows=torch.tensor(rows, dtype=torch.int64),
        presence=torch.tensor([s.params.presence_penalty for s in seqs], dtype=torch.float32),
        frequency=torch.tensor([s.params.frequency_penalty for s in seqs], dtype=torch.float32),
        repetition=torch.tensor([s.params.repetition_penalty for s in seqs], dtype=torch.float32),
        output_rows=index.repeat_interleave(torch.tensor([t.numel() for t in outputs])),
        output_tokens=torch.cat(outputs),
        prompt_rows=index.repeat_interleave(torch.tensor([t.numel() for t in prompts])),
        prompt_tokens=torch.cat(prompts),
    )


def apply_penalties(logits: torch.Tensor, batch: PenaltyBatch) -> None:
    """Penalize, in place, the rows of ``logits`` [S, V] that ``batch`` names."""
    device = logits.device
    rows = batch.rows.to(device)
    sub = logits[rows]
    num_rows, vocab = sub.shape
    counts = torch.zeros(num_rows, vocab, dtype=sub.dtype, device=device)
    counts.index_put_(
        (batch.output_rows.to(device), batch.output_tokens.to(device)),
        torch.ones(batch.output_tokens.numel(), dtype=sub.dtype, device=device),
        accumulate=True,
    )
    generated = counts > 0
    seen = generated.clone()
    seen[batch.prompt_rows.to(device), batch.prompt_tokens.to(device)] = True
    repetition = batch.repetition.to(device).unsqueeze(1)
    penalized = torch.where(sub > 0, sub / repetition, sub * repetition)
    sub = torch.where(seen, penalized, sub)
    sub = sub - batch.frequency.to(device).unsqueeze(1) * counts
    sub = sub - batch.presence.to(device).unsqueeze(1) * generated.to(sub.dtype)
    logits[rows] = sub
