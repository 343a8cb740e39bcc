"""Verification of draft tokens against the target model's distribution at each position.

A sequence's verify row has 1 + k positions: its last known token, then its k drafts. At a
draft position j the model's distribution p_j (after the grammar, processors, temperature,
top-k and top-p: exactly what the plain sampler draws from) decides whether draft d_j is
kept. Greedy rows keep d_j while it is the argmax, and emit the argmax at the first
mismatch (or after the last draft): the plain greedy tokens, one for one. Random rows keep
d_j with probability p_j(d_j) and otherwise emit a token drawn from p_j with d_j removed and
the rest renormalized: n-gram drafts are deterministic (a draft distribution q that is one
token), and for such q this is the standard rejection rule min(1, p/q) with the residual
max(0, p - q), so each emitted token is distributed as p_j (P[x] = p(d)[x = d] +
(1 - p(d)) p(x) / (1 - p(d)) [x != d]). After the last draft (every draft kept) the row's
token is drawn from p_k itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.core.llm.forward_input import DraftRows

# (unnormalized probabilities [P, V], uniforms [P, 1]) -> one token per row: the sampler's.
DrawFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Verified:
    position_tokens: torch.Tensor  # [P] what each position would emit (for the processors)
    tokens: list[int]  # [S] each sequence's token after its accepted drafts
    num_accepted: list[int]  # [S]
    positions: list[int]  # [S] the position (row of the logits) each token comes from


def draft_per_position(drafts: DraftRows) -> torch.Tensor:
    """[P] the draft at each position; -1 at each sequence's last position (no draft)."""
    out: list[int] = []
    at = 0
    for k in drafts.num_drafts:
        out += drafts.token_ids[at : at + k]
        out.append(-1)
        at += k
    return torch.tensor(out, dtype=torch.int64)


def verify(
    argmax: torch.Tensor,
    probs: torch.Tensor | None,
    greedy: torch.Tensor,
    drafts: DraftRows,
    uniform: torch.Tensor | None,
    accept_uniform: torch.Tensor | None,
    draw: DrawFn,
) -> Verified:
    """``argmax`` [P]: the processed logits' argmax; ``probs`` [P, V]: the unnormalized
    distributions of the random positions (None when every row is greedy); ``greedy`` [P];
    ``uniform`` [P, 1] float64 draws the emitted tokens are sampled with, ``accept_uniform``
    [P] float64 draws the drafts are accepted with (None with ``probs``); ``draw``: how the
    plain sampler draws from a distribution with a uniform number."""
    draft = draft_per_position(drafts).to(argmax.device)
    is_draft = draft >= 0
    if probs is None:
        tokens = argmax
        accept = is_draft & (argmax == draft)
    else:
        assert uniform is not None and accept_uniform is not None
        safe = draft.clamp(min=0).unsqueeze(1)
        total = probs.sum(dim=-1)
        p_draft = probs.gather(1, safe).squeeze(1) / torch.where(total > 0, total, 1.0)
        kept = accept_uniform.to(probs.device) < p_draft.double()
        # The residual at a draft position: p without the draft (never drawn there again).
        residual = probs.scatter(1, safe, torch.zeros_like(probs[:, :1]))
        residual = torch.where(is_draft.unsqueeze(1), residual, probs)
        sampled = draw(residual, uniform)
        tokens = torch.where(greedy, argmax, sampled)
        accept = is_draft & torch.where(greedy, argmax == draft, kept)
    accepted = accept.tolist()
    emitted = tokens.tolist()
    out_tokens: list[int] = []
    num_accepted: list[int] = []
    positions: list[int] = []
    at = 0
    for k in drafts.num_drafts:
        a = 0
        while a < k and accepted[at + a]:
            a += 1
        out_tokens.append(emitted[at + a])
        num_accepted.append(a)
        positions.append(at + a)
        at += k + 1
    return Verified(tokens, out_tokens, num_accepted, positions)
