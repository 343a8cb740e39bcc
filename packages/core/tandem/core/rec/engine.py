"""The recommendation engine: a loop thread that admits batches from the fixed-steps
scheduler, runs each batch's prefill and decode rounds on its pipeline lane one after another
(batches on different lanes at once), and delivers every request's ranked candidates.

Nothing waits forever: a failed step fails the requests of its batch and frees its blocks;
stopping fails what is still waiting.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Protocol

import torch

from tandem.core.errors import EngineDeadError
from tandem.core.rec.fixed_steps_scheduler import FixedStepsScheduler, RecBatch
from tandem.core.rec.request import RecRequest, RecResult
from tandem.core.rec.runner import pad_block_tables
from tandem.core.rec.step import RecPrefill, RecStep, RecStepOutput
from tandem.device.sync import REAL_SYNC, Promise, Sync

logger = logging.getLogger(__name__)


class RecStepSubmitter(Protocol):
    """Where batches' steps go: the executor's lanes (or the simulator's fake engine)."""

    def submit(self, lane: int, step: RecStep) -> Promise[RecStepOutput]: ...


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
    ) -> None:
        self.steps = steps
        self.scheduler = scheduler
        self._sync = sync
        self._cond = sync.condition()
        self._completions: deque[tuple[RecBatch, Promise[RecStepOutput]]] = deque()
        self._in_flight: dict[int, RecBatch] = {}
        self._wake = False
        self._running = True
        self._error: BaseException | None = None
        self.steps_submitted = 0
        self._thread = sync.start_thread(self._loop, "tandem-rec-engine")

    def submit(self, *requests: RecRequest) -> list[Promise[RecResult]]:
        """Queue ``requests`` together (InvalidRequestError, none queued, if one could never
        be served)."""
        if not self._running:
            raise EngineDeadError(f"the recommendation engine is not running ({self._error})")
        self.scheduler.add(*requests)
        with self._cond:
            self._wake = True
            self._cond.notify_all()
        return [r.result for r in requests]

    @property
    def is_running(self) -> bool:
        return self._running and self._thread.is_alive()

    def _loop(self) -> None:
        try:
            while True:
                batch = self.scheduler.next_batch()
                while batch is not None:
                    self._launch(batch, prefill_step(batch))
                    batch = self.scheduler.next_batch()
                with self._cond:
                    while self._running and not self._completions and not self._wake:
                        self._cond.wait()
                    if not self._running:
                        return
                    self._wake = False
                    done = list(self._completions)
                    self._completions.clear()
                for finished_batch, promise in done:
                    self._complete(finished_batch, promise)
        except BaseException as exc:
            logger.exception("the recommendation engine loop failed")
            self._error = exc
        finally:
            self._running = False
            self._fail_everything(
                EngineDeadError(f"the recommendation engine stopped: {self._error}")
            )

    def _launch(self, batch: RecBatch, step: RecStep) -> None:
        self._in_flight[batch.batch_id] = batch
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

    def _complete(self, batch: RecBatch, promise: Promise[RecStepOutput]) -> None:
        error = promise.exception()
        if error is not None:
            logger.error("batch %d failed in round %d: %s", batch.batch_id, batch.round, error)
            self._finish(batch, error)
            return
        out = promise.result()
        if not out.finished:
            if batch.round >= self.scheduler.max_decode_rounds:
                self._finish(batch, EngineDeadError("the model ran past its decode rounds"))
                return
            self._launch(batch, RecStep(batch.batch_id, batch.round + 1))
            return
        assert out.candidates is not None and out.scores is not None
        for request, candidates, scores in zip(
            batch.requests, out.candidates, out.scores, strict=True
        ):
            request.result.set_result(RecResult(request.request_id, candidates, scores))
        self._finish(batch, None)

    def _finish(self, batch: RecBatch, error: BaseException | None) -> None:
        del self._in_flight[batch.batch_id]
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
