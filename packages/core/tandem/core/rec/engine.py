"""The recommendation engine: a loop thread that admits batches from the fixed-steps
scheduler, runs each batch's prefill and decode rounds on its pipeline lane one after another
(batches on different lanes at once), and delivers every request's ranked candidates.

Nothing waits forever: a step that fails (or runs past the step timeout) on any rank stops
the engine and fails every request with the cause, their blocks freed; stopping fails what
is still waiting; requests that could never be admitted (blocks that leaked) fail at once.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Protocol

import torch

from tandem.core.errors import EngineDeadError
from tandem.core.executor.step_timeout import STEP_TIMEOUT_GRACE_S
from tandem.core.failure_text import describe
from tandem.core.llm.stall_watch import check_step_health
from tandem.core.rec.fixed_steps_scheduler import FixedStepsScheduler, RecBatch
from tandem.core.rec.request import RecRequest, RecResult
from tandem.core.rec.runner import pad_block_tables
from tandem.core.rec.step import RecPrefill, RecStep, RecStepOutput
from tandem.device.sync import REAL_SYNC, Promise, Sync

logger = logging.getLogger(__name__)


class RecStepSubmitter(Protocol):
    """Where batches' steps go: the executor's lanes (or the simulator's fake engine)."""

    def submit(self, lane: int, step: RecStep) -> Promise[RecStepOutput]: ...

    def timed_out(self, lane: int, timeout: float) -> EngineDeadError:
        """The step on ``lane`` ran past ``timeout``: release its ranks, name the late ones."""
        ...


def prefill_step(batch: RecBatch) -> RecStep:
    """Round 0 of ``batch``: its histories padded into one tensor (copies the step owns)."""
    requests = batch.requests
    longest = max(r.history_len for r in requests)
    codebooks = int(requests[0].history.shape[1])
    histories = torch.zeros(len(requests), longest, codebooks, dtype=torch.int64)
    for i, request in enumerate(requests):
        histories[i, : request.history_len] = request.history
    prefill = RecPrefill(
        histories=histories,
        lengths=torch.tensor([r.history_len for r in requests], dtype=torch.int64),
        block_tables=pad_block_tables([list(r.blocks) for r in requests]),
        beam_widths=torch.tensor([r.beam_width for r in requests], dtype=torch.int64),
        num_candidates=tuple(r.num_candidates for r in requests),
    )
    return RecStep(batch.batch_id, 0, prefill)


class RecEngine:
    def __init__(
        self,
        steps: RecStepSubmitter,
        scheduler: FixedStepsScheduler,
        sync: Sync = REAL_SYNC,
        step_timeout_s: float = 300.0,
        health_timeout_s: float = 60.0,
        kv_exhaust_step: int | None = None,
    ) -> None:
        """``kv_exhaust_step``: an injected fault (tests): before that step, every free KV
        block is taken away for good."""
        self.steps = steps
        self.scheduler = scheduler
        self._sync = sync
        self._cond = sync.condition()
        self._completions: deque[tuple[RecBatch, Promise[RecStepOutput]]] = deque()
        self._in_flight: dict[int, RecBatch] = {}
        # When each in-flight batch's current round was submitted.
        self._launched_at: dict[int, float] = {}
        # The oldest of those (None: nothing in flight); /health reads it from other threads.
        self._busy_since: float | None = None
        self._step_timeout_s = step_timeout_s
        self._step_deadline_s = step_timeout_s + STEP_TIMEOUT_GRACE_S
        self._health_timeout_s = health_timeout_s
        self._kv_exhaust_step = kv_exhaust_step
        self._wake = False
        self._running = True
        # Set by refuse_new (shutting down): why new requests are refused.
        self._refusing: str | None = None
        self._error: BaseException | None = None
        # Why the engine failed (a step on some rank, a stall), once it has.
        self.dead: str | None = None
        self.steps_submitted = 0
        self._thread = sync.start_thread(self._loop, "tandem-rec-engine")

    def submit(self, *requests: RecRequest) -> list[Promise[RecResult]]:
        """Queue ``requests`` together (InvalidRequestError, none queued, if one could never
        be served; EngineOverloadedError, none queued, past the scheduler's capacity)."""
        with self._cond:
            # Under the lock the loop's end takes too: a request is either refused here or
            # queued before the loop fails what is waiting, never lost in between.
            if not self._running:
                raise EngineDeadError(self.dead or "the recommendation engine has stopped")
            if self._refusing is not None:
                raise EngineDeadError(self._refusing)
            self.scheduler.add(*requests)
            self._wake = True
            self._cond.notify_all()
        return [r.result for r in requests]

    def refuse_new(self, reason: str) -> None:
        """Refuse new requests and fail the waiting ones with ``reason`` now; batches in
        flight run to their end (a few rounds)."""
        with self._cond:
            self._refusing = reason
        for request in self.scheduler.remove_waiting():
            request.result.set_exception(EngineDeadError(reason))

    @property
    def is_running(self) -> bool:
        return self._running and self._thread.is_alive()

    def check_health(self) -> None:
        """EngineDeadError once the engine failed or stopped; EngineUnhealthyError while a
        step has run past the health deadline (any thread)."""
        if not self.is_running:
            raise EngineDeadError(self.dead or "the recommendation engine loop is not running")
        since = self._busy_since
        if since is not None:
            check_step_health(
                self._sync.monotonic() - since, self._health_timeout_s, self._step_timeout_s
            )

    def _loop(self) -> None:
        try:
            while True:
                self._admit()
                with self._cond:
                    while self._running and not self._completions and not self._wake:
                        if not self._in_flight:
                            self._cond.wait()
                            continue
                        oldest = min(self._launched_at.values())
                        left = oldest + self._step_deadline_s - self._sync.monotonic()
                        if left <= 0:
                            break
                        self._cond.wait(left)
                    if not self._running:
                        return
                    self._wake = False
                    done = list(self._completions)
                    self._completions.clear()
                for finished_batch, promise in done:
                    self._complete(finished_batch, promise)
                self._check_step_timeout()
        except _EngineFailed as failed:
            self.dead = str(failed)
            logger.error("the recommendation engine failed: %s", self.dead)
        except BaseException as exc:
            logger.exception("the recommendation engine loop failed")
            self._error = exc
            self.dead = f"the recommendation engine loop crashed: {describe(exc)}"
        finally:
            with self._cond:
                self._running = False
            self._busy_since = None
            self._fail_everything(
                EngineDeadError(self.dead or "the recommendation engine has stopped")
            )

    def _admit(self) -> None:
        fault = self._kv_exhaust_step
        if fault is not None and self.steps_submitted >= fault:
            blocks = self.scheduler.blocks
            if blocks.num_free_blocks:
                logger.warning("injected fault: %d free KV blocks taken away for good",
                               blocks.num_free_blocks)  # fmt: skip
                blocks.reserve(blocks.num_free_blocks)
        batch = self.scheduler.next_batch()
        while batch is not None:
            self._launch(batch, prefill_step(batch))
            batch = self.scheduler.next_batch()
        if self.scheduler.stuck():
            # It would wait for ever: fail it, and everything, now.
            blocks = self.scheduler.blocks
            raise _EngineFailed(
                f"the recommendation engine could not admit {self.scheduler.num_waiting} "
                f"waiting requests with nothing in flight ({blocks.num_free_blocks} of "
                f"{blocks.num_blocks} KV blocks free); this is a bug, please report it"
            )

    def _check_step_timeout(self) -> None:
        now = self._sync.monotonic()
        for batch_id, at in list(self._launched_at.items()):
            if now - at >= self._step_deadline_s:
                lane = self._in_flight[batch_id].lane
                error = self.steps.timed_out(lane, self._step_timeout_s)
                raise _EngineFailed(f"the engine failed: {error}")

    def _launch(self, batch: RecBatch, step: RecStep) -> None:
        self._in_flight[batch.batch_id] = batch
        self._launched_at[batch.batch_id] = self._sync.monotonic()
        self._update_busy()
        batch.round = step.round
        try:
            promise = self.steps.submit(batch.lane, step)
        except BaseException as exc:  # noqa: BLE001 - the batch fails, the engine goes on
            failed: Promise[RecStepOutput] = Promise(self._sync)
            failed.set_exception(exc)
            promise = failed
        self.steps_submitted += 1

        def on_done(p: Promise[RecStepOutput]) -> None:
            with self._cond:
                self._completions.append((batch, p))
                self._cond.notify_all()

        promise.add_done_callback(on_done)

    def _update_busy(self) -> None:
        self._busy_since = min(self._launched_at.values()) if self._launched_at else None

    def _complete(self, batch: RecBatch, promise: Promise[RecStepOutput]) -> None:
        self._launched_at.pop(batch.batch_id, None)
        self._update_busy()
        error = promise.exception()
        if error is not None:
            # A step that failed on any rank leaves the devices in a state nothing vouches
            # for: the engine stops and every request fails with the cause.
            logger.error("batch %d failed in round %d: %s", batch.batch_id, batch.round, error)
            cause = str(error) if isinstance(error, EngineDeadError) else describe(error)
            raise _EngineFailed(f"the engine failed: {cause}")
        out = promise.result()
        if not out.finished:
            if batch.round >= self.scheduler.max_decode_rounds:
                self._finish(batch, EngineDeadError("the model ran past its decode rounds"))
                return
            self._launch(batch, RecStep(batch.batch_id, batch.round + 1))
            return
        assert out.candidates is not None and out.scores is not None
        # Places and blocks back first: a client that sends its next request as soon as it
        # has this answer must not find its own finished request still counted against
        # --max-num-seqs + --max-waiting-requests.
        self._finish(batch, None)
        for request, candidates, scores in zip(
            batch.requests, out.candidates, out.scores, strict=True
        ):
            request.result.set_result(RecResult(request.request_id, candidates, scores))

    def _finish(self, batch: RecBatch, error: BaseException | None) -> None:
        del self._in_flight[batch.batch_id]
        self._launched_at.pop(batch.batch_id, None)
        if error is not None:
            for request in batch.requests:
                if not request.result.done():
                    request.result.set_exception(error)
        self.scheduler.finish(batch)

    def _fail_everything(self, error: BaseException) -> None:
        for request in self.scheduler.remove_waiting():
            request.result.set_exception(error)
        for batch in list(self._in_flight.values()):
            self._finish(batch, error)

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._running = False
            self._cond.notify_all()
        self._thread.join(timeout)


class _EngineFailed(Exception):
    """Stops the loop: every request fails with this message."""
