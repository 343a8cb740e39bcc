"""A recommendation step runner with no model, for scheduler tests: it fakes the block pool
(a real BlockManager of ``num_blocks`` blocks with no KV memory behind it) and completes steps
only when told to, so tests can hold steps open and create overlaps on purpose.

It also checks what a real worker would rely on: a batch's rounds arrive in order on the lane
it started on, no lane runs two steps at once, and a prefill's blocks are reserved and
disjoint from every other in-flight batch's."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.core.errors import EngineDeadError
from tandem.core.kv.block_manager import BlockManager
from tandem.core.rec.step import RecStep, RecStepOutput
from tandem.device.sync import REAL_SYNC, Promise, Sync


@dataclass
class _Open:
    lane: int
    step: RecStep
    promise: Promise[RecStepOutput]


class FakeEngine:
    def __init__(
        self, num_blocks: int, block_size: int, max_decode_rounds: int, sync: Sync = REAL_SYNC
    ) -> None:
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_cache=False, sync=sync)
        self.block_size = block_size
        self.max_decode_rounds = max_decode_rounds
        self._sync = sync
        self._cond = sync.condition()
        self._hold = False
        self._open: list[_Open] = []
        self._batch_lane: dict[int, int] = {}
        self._batch_round: dict[int, int] = {}
        self._batch_blocks: dict[int, set[int]] = {}
        self._batch_candidates: dict[int, tuple[int, ...]] = {}
        self.step_calls = 0
        self.max_open = 0
        self.violations: list[str] = []

    def hold(self) -> None:
        """From now on, steps stay open until ``release``."""
        with self._cond:
            self._hold = True

    def release(self, count: int | None = None) -> int:
        """Complete up to ``count`` open steps (all by default), oldest first; stop holding
        when ``count`` is None. Returns how many were completed."""
        with self._cond:
            chosen = self._open if count is None else self._open[:count]
            self._open = self._open[len(chosen) :]
            if count is None:
                self._hold = False
        for item in chosen:
            item.promise.set_result(self._output(item.step))
        return len(chosen)

    def wait_open(self, count: int, timeout: float = 10.0) -> None:
        """Until at least ``count`` steps are open."""
        deadline = self._sync.monotonic() + timeout
        with self._cond:
            while len(self._open) < count:
                left = deadline - self._sync.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(self._open)} steps open, waited for {count}")
                self._cond.wait(left)

    @property
    def open_steps(self) -> list[tuple[int, int, int]]:
        """(lane, batch, round) of every open step."""
        with self._cond:
            return [(o.lane, o.step.batch_id, o.step.round) for o in self._open]

    def submit(self, lane: int, step: RecStep) -> Promise[RecStepOutput]:
        promise: Promise[RecStepOutput] = Promise(self._sync)
        with self._cond:
            self.step_calls += 1
            self._check(lane, step)
            if self._hold:
                self._open.append(_Open(lane, step, promise))
                self.max_open = max(self.max_open, len(self._open))
                self._cond.notify_all()
                return promise
        promise.set_result(self._output(step))
        return promise

    def timed_out(self, lane: int, timeout: float) -> EngineDeadError:
        return EngineDeadError(f"the fake engine held lane {lane}'s step over {timeout:g} s")

    def _check(self, lane: int, step: RecStep) -> None:
        busy = {o.lane for o in self._open}
        if lane in busy:
            self.violations.append(f"lane {lane} got a step while running another")
        if step.round == 0:
            assert step.prefill is not None
            blocks = {b for row in step.prefill.block_tables.tolist() for b in row if b}
            for other, held in self._batch_blocks.items():
                if held & blocks:
                    self.violations.append(f"batch {step.batch_id} shares blocks with {other}")
            self._batch_blocks[step.batch_id] = blocks
            self._batch_lane[step.batch_id] = lane
            self._batch_candidates[step.batch_id] = step.prefill.num_candidates
        else:
            if self._batch_lane.get(step.batch_id) != lane:
                self.violations.append(f"batch {step.batch_id} moved lanes")
            if self._batch_round.get(step.batch_id) != step.round - 1:
                self.violations.append(f"batch {step.batch_id} skipped to round {step.round}")
        self._batch_round[step.batch_id] = step.round

    def _output(self, step: RecStep) -> RecStepOutput:
        if step.round < self.max_decode_rounds:
            return RecStepOutput(step.batch_id, step.round, finished=False)
        with self._cond:
            wanted = self._batch_candidates.pop(step.batch_id)
            self._batch_blocks.pop(step.batch_id, None)
        candidates: list[list[tuple[int, ...]]] = [
            [(step.batch_id, i) for i in range(k)] for k in wanted
        ]
        scores = [[-float(i) for i in range(k)] for k in wanted]
        return RecStepOutput(step.batch_id, step.round, True, candidates, scores)
