"""Deliberately broken variants of the bugs of xLLM pull requests #1894 and #1453, kept as
fixtures the explorers must catch. Nothing in ``packages/`` uses them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.core.config import EngineConfig
from tandem.core.executor.executor import LaneExecutor
from tandem.core.executor.thread_executor import ThreadExecutor
from tandem.core.llm.engine import LLMEngine
from tandem.core.llm.forward_input import ForwardInput, SamplerOutput
from tandem.core.llm.outputs import RequestOutput
from tandem.core.llm.pipelined_stepping import PipelinedStepping
from tandem.core.llm.scheduler import SchedulerOutput
from tandem.core.rec.engine import RecEngine
from tandem.core.worker.lane_stager import LaneStager
from tandem.device.kernel_registry import KernelKey
from tandem.device.scratch_allocator import ScratchBlock
from tandem.device.sync import REAL_SYNC, Sync
from tandem_sim.fake_runtime import RuntimeFault


@dataclass
class _Entry:
    stub: str | None = None


class UnsynchronizedRegistry:
    """torch_npu_ops' KernelRegistry as xLLM pull request #1894's review found it: find, emplace
    (ignoring that another thread already did), register, and on failure erase the shared entry,
    leaving the winner's users a null stub. A thread that finds an entry still being registered
    reads its null stub and fails as the review's launch through it did."""

    def __init__(self, sync: Sync) -> None:
        self._sync = sync
        self._entries: dict[KernelKey, _Entry] = {}

    def get(self, key: KernelKey, register: Callable[[], str]) -> str | None:
        entry = self._entries.get(key)
        self._sync.yield_point("kernel_infos_.find")
        if entry is None:
            entry = self._entries.setdefault(key, _Entry())
            self._sync.yield_point("kernel_infos_.emplace")
            try:
                entry.stub = register()
            except BaseException:
                self._entries.pop(key, None)
                entry.stub = None
                raise
        self._sync.yield_point("read stub")
        if entry.stub is None:
            raise RuntimeFault(f"Kernel stub is null: {key.kernel}@{key.device}")
        return entry.stub


class UnrecordedStager(LaneStager):
    """The workspace of xLLM pull request #1453: the block is handed to a stream but never
    recorded on it, so the allocator may hand it out again while the stream still reads it."""

    def _record(self, block: ScratchBlock) -> None:
        return None


class DecodeOnlyStepping(PipelinedStepping):
    """The engine's launch rule before the livelock fix: with nothing in flight and one
    decode token per running sequence it asked only for a decode-only batch, which skips
    sequences without room for their next block and never preempts, so once none had room
    the engine spun with nothing in flight."""

    def _next_batch(self) -> tuple[SchedulerOutput, bool]:
        if not self.in_flight.steps and self.scheduler.needs_full_step():
            return self.scheduler.schedule(), True
        share = -(-self.scheduler.num_running // self.parts.config.pipeline.max_concurrency)
        busy = self.in_flight.busy_ids()
        return self.scheduler.schedule_decodes(exclude=busy, max_seqs=share), False


class DecodeOnlyEngine(LLMEngine):
    """The pipelined engine with ``DecodeOnlyStepping``."""

    def __init__(
        self,
        config: EngineConfig,
        executor: LaneExecutor[ForwardInput, SamplerOutput] | None = None,
        sync: Sync = REAL_SYNC,
    ) -> None:
        super().__init__(config, executor, sync)
        assert isinstance(self.stepper, PipelinedStepping)
        self.stepper = DecodeOnlyStepping(self.stepper.parts)


class LeakyAbortEngine(LLMEngine):
    """An abort that takes the request out of the queues but forgets its KV blocks."""

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.sequences.get(request_id)
        if seq is None:
            return None
        self.scheduler.finish(seq, "abort", free_now=False)
        out = self._finish_output(seq)
        self._publish_stats()
        return out


class NoAbortExecutor(ThreadExecutor[Any, Any]):
    """A failure path that never aborts the communicator: ranks in a collective with the
    failed one wait out the timeout (300 s) instead of being released."""

    def _abort_lane(self, lane: int, reason: str) -> None:
        return None


class FailureForgetsBatchesEngine(RecEngine):
    """On failure, fails the waiting requests but forgets the batches in flight: their
    requests never get an answer and their blocks stay reserved."""

    def _fail_everything(self, error: BaseException) -> None:
        for request in self.scheduler.remove_waiting():
            request.result.set_exception(error)
