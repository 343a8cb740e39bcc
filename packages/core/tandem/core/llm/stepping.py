"""How the engine's steps are scheduled, built and launched, one mode picked once from the
config: one step at a time (``SerialStepping``); one at a time with the next decode launched
ahead of the host work on the last one's outputs (``LaunchAheadStepping``, accelerators); or
up to ``--max-concurrency`` steps in flight on the workers' pipeline lanes
(``PipelinedStepping``, in ``pipelined_stepping.py``).

Each hands the engine the step to complete next; the engine waits for it and processes its
outputs. Called on the engine's thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from tandem.core.config import EngineConfig
from tandem.core.errors import EngineDeadError
from tandem.core.executor.executor import (
    Executor,
    LaneExecutor,
    create_executor,
    create_lane_executor,
)
from tandem.core.executor.step_timeout import STEP_TIMEOUT_GRACE_S
from tandem.core.failure_text import describe
from tandem.core.llm.forward_input import ForwardInput, SamplerOutput
from tandem.core.llm.in_flight import InFlight, InFlightSteps
from tandem.core.llm.input_builder import build_forward_input, failing_entries
from tandem.core.llm.model_runner import LLMRunnerFactory
from tandem.core.llm.sampling_rows import SamplingRows
from tandem.core.llm.scheduler import Scheduler, SchedulerOutput
from tandem.core.llm.sequence import TokenSequence
from tandem.core.llm.stall_watch import StallWatch
from tandem.device.sync import Sync
from tandem.device.task_thread import TaskThread

logger = logging.getLogger(__name__)

# A sequence whose token was just appended, and its row in the step's sampler output.
Sampled = tuple[TokenSequence, int]


@dataclass(frozen=True)
class DueStep:
    """A launched step (or one to run on ``wait``) and how to get its result."""

    out: SchedulerOutput
    wait: Callable[[], SamplerOutput]


@dataclass(frozen=True)
class StepParts:
    """What every stepping mode works with, all the engine's."""

    config: EngineConfig
    scheduler: Scheduler
    executor: Executor[ForwardInput, SamplerOutput]
    # The executor's pipeline lanes (pipelined stepping only).
    lanes: LaneExecutor[ForwardInput, SamplerOutput] | None
    in_flight: InFlightSteps
    watch: StallWatch
    sampling_rows: SamplingRows
    sync: Sync
    # Takes a request that failed while its batch was built (already finished with its
    # error), to deliver its output with the step's.
    finished_early: Callable[[TokenSequence], None]


class Stepper(Protocol):
    def next_step(self) -> DueStep | None:
        """Launch what can run now; the step to complete next (None: none is due, and none
        was launched unless every request of its batch failed)."""
        ...

    def on_sampled(self, sampled: list[Sampled]) -> None:
        """The tokens of the step just completed are appended; the rest of its outputs is
        processed after this returns."""
        ...

    def shutdown(self) -> None: ...


StepperFactory = Callable[[StepParts], Stepper]


def pick_stepping(config: EngineConfig, sync: Sync) -> StepperFactory:
    """The mode ``config`` asks for. Picked before the workers start, so that a bad
    ``--devices`` is refused first and the launcher thread starts before them."""
    if config.pipeline.max_concurrency > 1:
        from tandem.core.llm.pipelined_stepping import PipelinedStepping

        return PipelinedStepping
    # A step launched ahead is a plain decode: speculation would lose its drafts every
    # other step, so it runs one step at a time.
    if config.speculative is None and config.pipeline.launches_ahead(config.parallel.devices):
        # Runs the step launched ahead, so the engine's thread is free while it runs.
        launcher = TaskThread("tandem-step-launcher", sync)
        return lambda parts: LaunchAheadStepping(parts, launcher)
    return SerialStepping


def step_executor(
    config: EngineConfig,
    factory: LLMRunnerFactory,
    given: LaneExecutor[ForwardInput, SamplerOutput] | None,
) -> tuple[Executor[ForwardInput, SamplerOutput], LaneExecutor[ForwardInput, SamplerOutput] | None]:
    """The executor the topology calls for (``given``: one built by the caller, the
    simulator's on fake devices), and its lanes where steps are pipelined."""
    pipelined = config.pipeline.max_concurrency > 1
    if given is not None:
        return given, given if pipelined else None
    if pipelined:
        lanes = create_lane_executor(config, factory)
        return lanes, lanes
    return create_executor(config, factory), None


class SteppingBase:
    def __init__(self, parts: StepParts) -> None:
        self.parts = parts
        self.scheduler = parts.scheduler
        self.in_flight = parts.in_flight
        self.watch = parts.watch
        self.sync = parts.sync
        spec = parts.config.speculative
        # A multi-token-prediction head drafts on the workers, from inputs built with the step.
        self._ahead = spec is not None and spec.drafts_with_head

    def on_sampled(self, sampled: list[Sampled]) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def schedule_full(self) -> SchedulerOutput:
        """The scheduler's full path (admits, prefills, preempts). A pass that only preempted
        is followed by another, which admits or runs what the preemption made room for: an
        empty result then means there is truly nothing to run."""
        out = self.scheduler.schedule()
        while out.is_empty() and out.preempted:
            self.watch.progressed()
            out = self.scheduler.schedule()
        return out

    def build(self, out: SchedulerOutput) -> ForwardInput | None:
        """The batch's step input. A request whose part cannot be built fails alone (its
        output is delivered with the step's), and the rest run; None if none is left."""
        block_size = self.parts.config.cache.block_size
        try:
            return build_forward_input(
                out,
                block_size,
                self.parts.sampling_rows,
                alone=not self.in_flight.steps,
                ahead=self._ahead,
            )
        except Exception:
            logger.exception("building a batch of %d requests failed", len(out.scheduled))
        bad = failing_entries(out, block_size)
        if bad:
            out.scheduled = [e for e in out.scheduled if all(e is not b for b, _ in bad)]
        else:
            bad = [(e, RuntimeError("the batch could not be built")) for e in out.scheduled]
            out.scheduled = []
        for entry, error in bad:
            message = f"the request could not be batched: {describe(error)}"
            self.scheduler.finish(entry.seq, "error", error=message)
            self.parts.finished_early(entry.seq)
        if out.is_empty():
            # Rows rolled back for rejected drafts still need it before the next forward.
            self.scheduler.return_rollbacks(out)
            return None
        return self.build(out)


class SerialStepping(SteppingBase):
    """Schedule, build and run one step; the engine's thread waits for it."""

    def next_step(self) -> DueStep | None:
        out = self.schedule_full()
        if out.is_empty():
            return None
        fi = self.build(out)
        if fi is None:
            return None
        watch = self.watch
        watch.busy_since = self.sync.monotonic()
        executor = self.parts.executor

        def run() -> SamplerOutput:
            try:
                return executor.execute(fi)
            finally:
                watch.busy_since = None

        return DueStep(out, run)


class LaunchAheadStepping(SerialStepping):
    """One step at a time, the next launched ahead of the host work on the last one's
    outputs where nothing but decodes follows (see ``on_sampled``), on a launcher thread."""

    def __init__(self, parts: StepParts, launcher: TaskThread) -> None:
        super().__init__(parts)
        self._launcher = launcher

    def next_step(self) -> DueStep | None:
        """The step launched ahead, or else a step run as ``SerialStepping`` runs it."""
        if self.in_flight.steps:
            flight = self.in_flight.steps.popleft()
            return DueStep(flight.out, lambda: self._wait(flight))
        return super().next_step()

    def _wait(self, flight: InFlight) -> SamplerOutput:
        # The executor fails a step past the step timeout itself, naming the late ranks; this
        # is the backstop should it not answer at all.
        limit = 2 * self.parts.config.parallel.timeout_s + STEP_TIMEOUT_GRACE_S
        left = flight.launched_at + limit - self.sync.monotonic()
        try:
            return flight.promise.result(timeout=max(left, 0.0))
        except TimeoutError:
            raise EngineDeadError(
                f"a step has run for over {limit:g} s without its workers answering"
            ) from None
        finally:
            self.watch.busy_since = None
            self.in_flight.release_deferred()

    def on_sampled(self, sampled: list[Sampled]) -> None:
        """Launch the next step before the outputs of the one that just completed are
        processed, when it can only be every running sequence's next decode: its input is
        the tokens just sampled (already appended), and nothing the processing decides can
        change it, except that a request may end on a stop string, whose row is then wasted
        and whose blocks are freed when the step completes (like an abort's). Requests whose
        next input depends on that processing (grammars: their matchers advance there),
        waiting requests (the full path admits them) and tight KV space (the full path
        preempts) rule it out; so do requests that end here on a stop token or their
        length, which are left out. Logits processors keep their own state from the tokens
        they see sampled, so they do not."""
        sched = self.scheduler
        if len(sampled) != sched.num_running:
            return
        if sched.needs_full_step() or not sched.decodes_fit():
            return
        if any(seq.grammar is not None for seq, _ in sampled):
            return
        ending = {seq.request_id for seq, _ in sampled if seq.check_stop_token() is not None}
        out = sched.schedule_decodes(exclude=ending, max_seqs=sched.config.max_seqs_per_batch)
        if out.is_empty():
            return
        fi = self.build(out)
        if fi is None:
            return
        executor = self.parts.executor
        promise = self._launcher.submit(lambda: executor.execute(fi))
        now = self.sync.monotonic()
        ids = frozenset(e.seq.request_id for e in out.scheduled)
        self.in_flight.steps.append(InFlight(0, out, promise, ids, False, now))
        self.watch.busy_since = self.watch.last_progress = now
        self.in_flight.num_launched_ahead += 1

    def shutdown(self) -> None:
        # A step still running past this ends when the executor shuts its workers down.
        self._launcher.stop(timeout=5.0)
