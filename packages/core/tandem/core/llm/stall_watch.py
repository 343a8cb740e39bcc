"""The engine's two clocks and what they say: since when no step was launched or completed
(the watchdog's stall limit counts from there) and since when the oldest step still running
has run (``/health``'s deadline)."""

from __future__ import annotations

import logging

from tandem.core.config import ParallelConfig
from tandem.core.errors import EngineUnhealthyError
from tandem.core.llm.in_flight import InFlightSteps
from tandem.core.llm.scheduler import Scheduler
from tandem.device.sync import Sync

logger = logging.getLogger(__name__)


class StallWatch:
    def __init__(
        self, limits: ParallelConfig, scheduler: Scheduler, in_flight: InFlightSteps, sync: Sync
    ) -> None:
        self._limits = limits
        self._scheduler = scheduler
        self._in_flight = in_flight
        self._sync = sync
        self.last_progress = sync.monotonic()
        # When the oldest step still running started (None: none runs); /health reads it
        # from other threads.
        self.busy_since: float | None = None

    def progressed(self) -> None:
        """A step was launched or completed, or a sequence preempted."""
        self.last_progress = self._sync.monotonic()

    def stalled_for(self) -> float:
        """Seconds since a step was last launched or completed (or a sequence preempted)."""
        return self._sync.monotonic() - self.last_progress

    def check_busy(self) -> None:
        """EngineUnhealthyError while a step has run past the health deadline (any thread)."""
        since = self.busy_since
        limits = self._limits
        if since is not None:
            check_step_health(
                self._sync.monotonic() - since, limits.health_timeout_s, limits.timeout_s
            )

    def give_up(self) -> str:
        """Log the scheduler's state once; the error every request of a stalled engine fails
        with."""
        state = self.scheduler_state()
        logger.error("the engine made no progress for %.1f s; %s", self.stalled_for(), state)
        return (
            f"the engine could not schedule the request and gave up on it ({state}); this is "
            "a bug, please report it"
        )

    def scheduler_state(self) -> str:
        scheduler = self._scheduler
        running = scheduler.running
        blocks = scheduler.block_manager
        slots = scheduler.state_slots
        return (
            f"running {len(running)} (tokens to compute: "
            f"{[s.num_tokens - s.num_computed_tokens for s in running][:16]}), "
            f"waiting {scheduler.num_waiting}, in flight {len(self._in_flight)}, "
            f"free KV blocks {blocks.num_free_blocks} of {blocks.num_blocks}"
            + (
                f", free state slots {slots.num_free} of {slots.num_slots}"
                if slots is not None
                else ""
            )
        )


def check_step_health(running_s: float, health_timeout_s: float, timeout_s: float) -> None:
    """EngineUnhealthyError once a step has run ``running_s`` past the health deadline (it
    fails at ``timeout_s``)."""
    if running_s > health_timeout_s:
        raise EngineUnhealthyError(
            f"a step has been running for {running_s:.0f} s, over the {health_timeout_s:g} s "
            f"health deadline (it fails at {timeout_s:g} s)"
        )
