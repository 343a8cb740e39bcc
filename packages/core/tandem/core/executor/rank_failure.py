"""The one error a failed step ends with, naming the rank that caused it.

When one rank fails, the others fail after it: their collectives are aborted, or time out
waiting for it. The cause is the rank's own error (anything but those), else a rank that
never finished, else whatever is left; the client sees one line without library paths."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from tandem.collectives import CollectiveAborted, CollectiveTimeout
from tandem.core.errors import EngineDeadError
from tandem.core.failure_text import rank_failure

logger = logging.getLogger(__name__)

# Errors a rank gets because another one failed.
_CONSEQUENCES = (CollectiveAborted, CollectiveTimeout)


def step_failure(
    ranks: Sequence[tuple[int, str]],
    errors: Mapping[int, BaseException],
    late: Sequence[int],
    timeout: float | None,
    gone: Sequence[int] = (),
) -> EngineDeadError:
    """``ranks``: (global rank, device) by local rank; ``errors``: by local rank; ``late``:
    local ranks that did not finish within ``timeout`` seconds; ``gone``: local ranks whose
    worker thread died."""
    for local, error in errors.items():
        rank, device = ranks[local]
        logger.error("rank %d (%s) failed in a step", rank, device, exc_info=error)
    own = [r for r, e in errors.items() if not isinstance(e, _CONSEQUENCES)]
    parts: list[str] = []
    if own:
        rank, device = ranks[own[0]]
        parts.append(rank_failure(rank, device, errors[own[0]]))
    for local in gone:
        rank, device = ranks[local]
        parts.append(f"rank {rank} ({device}) stopped: its worker thread is gone")
    for local in late:
        rank, device = ranks[local]
        parts.append(f"rank {rank} ({device}) did not finish the step within {timeout:g} s")
    if not parts and errors:
        local, error = next(iter(errors.items()))
        rank, device = ranks[local]
        parts.append(rank_failure(rank, device, error))
    return EngineDeadError("; ".join(parts) or "a step failed on no rank in particular")
