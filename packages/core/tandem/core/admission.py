"""How many requests an engine takes in, shared by the LLM and the recommender: those that can
run at once plus ``--max-waiting-requests`` that may wait beside them. Past that a new request
is refused with "overloaded" (HTTP 503 with Retry-After) before it costs anything.

Counting the running ones too, not only the waiting ones, is what makes a burst at an idle
server admit the running places as well: at the burst's instant nothing runs yet, so a bound
on waiting alone would admit ``--max-waiting-requests`` and refuse the rest, leaving the
running places empty.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.core.errors import EngineOverloadedError


@dataclass(frozen=True)
class EngineCapacity:
    # Requests (sequences) the engine can run at once.
    running: int
    # What bounds ``running``, as the operator would change it (said in refusals and logs),
    # e.g. "--max-num-seqs 64".
    running_why: str
    # --max-waiting-requests; None: no bound, nothing is refused.
    waiting: int | None = None

    def admit(self, in_engine: int) -> None:
        """Raises EngineOverloadedError when ``in_engine`` requests (queued, waiting or
        running) fill the running and the waiting places. The caller adds a request's parts
        together after this, so one with more parts than the bound still gets in when the
        engine is short."""
        if self.waiting is None or in_engine < self.running + self.waiting:
            return
        raise EngineOverloadedError(
            f"the server is overloaded: {in_engine} requests are running or waiting already, "
            f"as many as {self.running_why} can run plus --max-waiting-requests "
            f"{self.waiting} may wait; retry later"
        )
