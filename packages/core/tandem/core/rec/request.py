"""A recommendation request: the user's history as semantic-id tuples, how many candidates to
return, and the promise its result is delivered through."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from tandem.core.errors import InvalidRequestError
from tandem.core.models.rec_config import RecModelConfig
from tandem.device.sync import REAL_SYNC, Promise, Sync

# Candidates one request may ask for (each needs a beam).
MAX_CANDIDATES = 256

_ids = itertools.count()


@dataclass(frozen=True)
class RecResult:
    request_id: str
    candidates: list[tuple[int, ...]]
    scores: list[float]


@dataclass(eq=False)
class RecRequest:
    request_id: str
    history: torch.Tensor  # [L, C] int64, owned (a copy of what the caller sent)
    num_candidates: int
    beam_width: int
    result: Promise[RecResult]
    # Blocks reserved for the request's whole life (prefill and every decode round).
    blocks: list[int] = field(default_factory=list)

    @property
    def history_len(self) -> int:
        return int(self.history.shape[0])


def make_rec_request(
    history: list[list[int]],
    num_candidates: int,
    model: RecModelConfig,
    beam_width: int,
    request_id: str | None = None,
    sync: Sync = REAL_SYNC,
) -> RecRequest:
    """Check a request against the model and build it; raises InvalidRequestError (HTTP 400)
    with the field at fault."""
    if not isinstance(history, list) or not history:
        raise InvalidRequestError("history must be a non-empty list of items", "history")
    if len(history) > model.max_history:
        raise InvalidRequestError(
            f"history has {len(history)} items; this model reads at most {model.max_history} "
            "(send the most recent ones)",
            "history",
        )
    for i, item in enumerate(history):
        if not isinstance(item, list) or len(item) != model.num_codebooks:
            raise InvalidRequestError(
                f"history[{i}] must be a list of {model.num_codebooks} semantic ids",
                "history",
            )
        for code in item:
            if isinstance(code, bool) or not isinstance(code, int):
                raise InvalidRequestError(f"history[{i}] holds a non-integer id", "history")
            if not 0 <= code < model.codebook_size:
                raise InvalidRequestError(
                    f"history[{i}] has id {code}, outside [0, {model.codebook_size})", "history"
                )
    if isinstance(num_candidates, bool) or not isinstance(num_candidates, int):
        raise InvalidRequestError("num_candidates must be an integer", "num_candidates")
    if not 1 <= num_candidates <= MAX_CANDIDATES:
        raise InvalidRequestError(
            f"num_candidates must be in [1, {MAX_CANDIDATES}], got {num_candidates}",
            "num_candidates",
        )
    return RecRequest(
        request_id=request_id or f"rec-{next(_ids)}",
        history=torch.tensor(history, dtype=torch.int64),
        num_candidates=num_candidates,
        beam_width=max(beam_width, num_candidates),
        result=Promise(sync),
    )
