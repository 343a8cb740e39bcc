"""Pipelined stepping (``--max-concurrency`` > 1): up to that many steps in flight on the
workers' pipeline lanes, the oldest completed first. A step that admits, prefills or preempts
runs alone; decode steps share the running sequences between lanes (disjoint sets, so results
match one step at a time). Speculative decodes verify their drafts in these steps too."""

from __future__ import annotations

from tandem.core.executor.step_timeout import STEP_TIMEOUT_GRACE_S
from tandem.core.llm.forward_input import SamplerOutput
from tandem.core.llm.in_flight import InFlight
from tandem.core.llm.scheduler import SchedulerOutput
from tandem.core.llm.stepping import DueStep, StepParts, SteppingBase
from tandem.device.sync import Promise


class PipelinedStepping(SteppingBase):
    def __init__(self, parts: StepParts) -> None:
        super().__init__(parts)
        assert parts.lanes is not None, "pipelined stepping runs on a lane executor"
        self.lanes = parts.lanes
        self._free_lanes = list(range(parts.config.pipeline.max_concurrency))
        # Set when a decode beside in-flight steps found no room: launch nothing more until
        # they drain, so the full path can preempt.
        self._draining = False

    def next_step(self) -> DueStep | None:
        self._launch()
        if not self.in_flight.steps:
            return None
        flight = self.in_flight.steps.popleft()
        return DueStep(flight.out, lambda: self._wait(flight))

    def _wait(self, flight: InFlight) -> SamplerOutput:
        timeout = self.parts.config.parallel.timeout_s
        left = flight.launched_at + timeout + STEP_TIMEOUT_GRACE_S - self.sync.monotonic()
        try:
            return flight.promise.result(timeout=max(left, 0.0))
        except TimeoutError:
            raise self.lanes.timed_out(flight.lane, timeout) from None
        finally:
            self._free_lanes.append(flight.lane)
            self.in_flight.release_deferred()
            steps = self.in_flight.steps
            self.watch.busy_since = steps[0].launched_at if steps else None

    def _next_batch(self) -> tuple[SchedulerOutput, bool]:
        """The next batch to launch and whether it must run alone.

        Completeness: with nothing in flight, the full path runs whenever a decode-only
        batch would not do (work other than one decode token per sequence, or a sequence
        without room for its next block); it always schedules, admits or preempts while
        there is work. With steps in flight, only decodes are launched beside them; once
        one is blocked for a block, nothing more is launched, the in-flight steps drain
        (each wait completes one), and the full path preempts. So every call launches,
        completes or preempts while requests remain, and the engine cannot spin in place.

        State slots (hybrid models) change none of this: only admission takes one, and a
        request waiting for a slot is work only the full path does. With nothing in flight
        every slot is held by a running sequence (an aborted one's deferred slot is released
        when its step completes), so the full path runs those, and their ends free slots.
        """
        width = self.parts.config.pipeline.max_concurrency
        share = -(-self.scheduler.num_running // width)
        if self.in_flight.steps:
            if self._draining:
                return SchedulerOutput(), False
            busy = self.in_flight.busy_ids()
            out = self.scheduler.schedule_decodes(exclude=busy, max_seqs=share)
            self._draining = out.blocked
            return out, False
        self._draining = False
        if not self.scheduler.needs_full_step() and self.scheduler.decodes_fit():
            return self.scheduler.schedule_decodes(exclude=set(), max_seqs=share), False
        return self.schedule_full(), True

    def _launch(self) -> None:
        steps = self.in_flight.steps
        while self._free_lanes and not any(f.exclusive for f in steps):
            out, exclusive = self._next_batch()
            if out.is_empty():
                return
            fi = self.build(out)
            if fi is None:
                continue
            lane = self._free_lanes.pop(0)
            try:
                promise = self.lanes.submit(lane, fi)
            except Exception as exc:  # noqa: BLE001 - becomes a failed step when waited for
                promise = Promise(self.sync)
                promise.set_exception(exc)
            # A sequence whose rejected drafts this step rolls back is busy until it has run.
            ids = frozenset(e.seq.request_id for e in out.scheduled) | out.rollback_ids
            now = self.sync.monotonic()
            steps.append(InFlight(lane, out, promise, ids, exclusive, now))
            self.watch.last_progress = now
            if self.watch.busy_since is None:
                self.watch.busy_since = now
