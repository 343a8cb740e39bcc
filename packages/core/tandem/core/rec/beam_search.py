"""Constrained beam search over semantic-id levels, batched over requests and beams: one
top-k over [requests, beams * codes] per level, the catalog's table masking codes that lead to
no item. Scores are summed log-probabilities."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.core.rec.catalog import Catalog


@dataclass(frozen=True)
class Beams:
    codes: torch.Tensor  # [R, W, level] int64, codes emitted so far
    scores: torch.Tensor  # [R, W] float32; -inf marks a beam that does not exist


def initial_beams(num_requests: int, width: int) -> Beams:
    """One live beam per request (the rest -inf), so the first level does not pick the same
    code once per identical beam."""
    scores = torch.full((num_requests, width), float("-inf"))
    scores[:, 0] = 0.0
    return Beams(torch.zeros(num_requests, width, 0, dtype=torch.int64), scores)


def beam_step(beams: Beams, logits: torch.Tensor, catalog: Catalog, widths: torch.Tensor) -> Beams:
    """Extend every beam by one level; ``widths`` [R] caps each request's live beams."""
    r, w, v = logits.shape
    logp = torch.log_softmax(logits.float(), dim=-1)
    allowed = catalog.allowed_next(beams.codes)
    candidates = (beams.scores.unsqueeze(-1) + logp).masked_fill(~allowed, float("-inf"))
    values, index = candidates.view(r, w * v).topk(w, dim=-1)
    parent = index // v
    code = index % v
    kept = torch.gather(beams.codes, 1, parent.unsqueeze(-1).expand(-1, -1, beams.codes.shape[2]))
    codes = torch.cat([kept, code.unsqueeze(-1)], dim=-1)
    beyond = torch.arange(w).unsqueeze(0) >= widths.unsqueeze(1)
    return Beams(codes, values.masked_fill(beyond, float("-inf")))


def best_candidates(
    beams: Beams, num_candidates: list[int]
) -> tuple[list[list[tuple[int, ...]]], list[list[float]]]:
    """Per request, its best ``num_candidates`` items and scores (beams stay sorted by score,
    as top-k returns them); fewer where the catalog has fewer matching items."""
    tuples: list[list[tuple[int, ...]]] = []
    scores: list[list[float]] = []
    codes = beams.codes.tolist()
    values = beams.scores.tolist()
    for i, k in enumerate(num_candidates):
        live = [j for j in range(len(values[i])) if values[i][j] != float("-inf")][:k]
        tuples.append([tuple(codes[i][j]) for j in live])
        scores.append([values[i][j] for j in live])
    return tuples, scores
