"""Steps launched and not yet completed, and the finished sequences whose KV blocks and state
slots they still write (released only once no step in flight names them)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tandem.core.llm.forward_input import SamplerOutput
from tandem.core.llm.scheduler import Scheduler, SchedulerOutput
from tandem.core.llm.sequence import TokenSequence
from tandem.device.sync import Promise


@dataclass(frozen=True)
class InFlight:
    lane: int
    out: SchedulerOutput
    promise: Promise[SamplerOutput]
    request_ids: frozenset[str]
    # Admits or prefills: nothing else runs beside it.
    exclusive: bool
    launched_at: float


class InFlightSteps:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.steps: deque[InFlight] = deque()
        self._deferred_free: list[TokenSequence] = []
        self.num_launched_ahead = 0

    def __len__(self) -> int:
        return len(self.steps)

    def busy_ids(self) -> set[str]:
        """Requests with a step in flight."""
        return {rid for f in self.steps for rid in f.request_ids}

    def finish(
        self,
        seq: TokenSequence,
        reason: str,
        error: str | None = None,
        busy: set[str] | None = None,
    ) -> None:
        """Finish ``seq``; ``busy``: ``busy_ids()`` if the caller has it at hand."""
        in_flight = seq.request_id in (self.busy_ids() if busy is None else busy)
        self.scheduler.finish(seq, reason, error=error, free_now=not in_flight)
        if in_flight:
            # Its step still writes the sequence's KV blocks and state slot: free them when
            # it completes.
            self._deferred_free.append(seq)

    def release_deferred(self) -> None:
        busy = self.busy_ids()
        keep = []
        for seq in self._deferred_free:
            if seq.request_id in busy:
                keep.append(seq)
            else:
                self.scheduler.release(seq)
        self._deferred_free = keep
