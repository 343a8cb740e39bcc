"""LLMEngine: requests in, one scheduled step at a time through the executor, outputs out.

Requests are prepared by ``inputs`` (``input_processor.py``) on any thread. Not thread-safe
otherwise; ``EngineLoop`` drives it from one thread for servers.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

from tandem.core.config import EngineConfig
from tandem.core.errors import (
    ConfigError,
    EngineDeadError,
    EngineUnhealthyError,
    InvalidRequestError,
)
from tandem.core.executor.executor import (
    Executor,
    LaneExecutor,
    create_executor,
    create_lane_executor,
)
from tandem.core.executor.step_timeout import STEP_TIMEOUT_GRACE_S
from tandem.core.failure_text import describe
from tandem.core.faults import KvExhaustion
from tandem.core.kv.block_manager import BlockManager
from tandem.core.kv.state_slots import StateSlotPool
from tandem.core.llm.forward_input import ForwardInput, PromptLogprobs, SamplerOutput
from tandem.core.llm.input_builder import build_forward_input, failing_entries
from tandem.core.llm.input_processor import InputProcessor, Prompt, eos_token_ids
from tandem.core.llm.model_runner import LLMRunnerFactory
from tandem.core.llm.output_processor import OutputProcessor
from tandem.core.llm.outputs import RequestOutput
from tandem.core.llm.sampling_params import SamplingParams
from tandem.core.llm.scheduler import Scheduler, SchedulerOutput
from tandem.core.llm.sequence import SequenceStatus, TokenLogprobs, TokenSequence
from tandem.core.llm.stats import EngineStats
from tandem.core.llm.structured_output import StructuredOutputs
from tandem.core.llm.tokenizer import Tokenizer
from tandem.device.sync import REAL_SYNC, Promise, Sync
from tandem.device.task_thread import TaskThread

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _InFlight:
    lane: int
    out: SchedulerOutput
    promise: Promise[SamplerOutput]
    request_ids: frozenset[str]
    # Admits or prefills: nothing else runs beside it.
    exclusive: bool
    launched_at: float


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        executor: LaneExecutor[ForwardInput, SamplerOutput] | None = None,
        sync: Sync = REAL_SYNC,
    ) -> None:
        """``executor``: one built by the caller (the simulator's, on fake devices); by
        default the one the topology calls for."""
        self.config = config
        self._sync = sync
        folder = Path(config.model.model)
        # Unknown architectures fail here, before any worker starts.
        factory = LLMRunnerFactory.from_folder(folder)
        self.model_config = factory.model_config
        self.tokenizer = Tokenizer(folder)
        limit = self.model_config.max_position_embeddings
        self.max_model_len = min(config.model.max_model_len or limit, limit)
        eos = eos_token_ids(self.model_config, self.tokenizer)
        self.structured_outputs = StructuredOutputs(
            self.tokenizer, self.model_config.vocab_size, eos, config.structured_output
        )
        # Pipelined stepping (--max-concurrency > 1): steps in flight on the workers' lanes.
        self._pipelined = config.pipeline.max_concurrency > 1
        # One step at a time, the next launched ahead of the host work on the last one's
        # outputs where nothing but decodes follows (see _launch_ahead): run by a thread of
        # its own, so the engine's thread is free while it runs.
        self._overlap = config.pipeline.launches_ahead(config.parallel.devices)
        self._launcher = TaskThread("tandem-step-launcher", sync) if self._overlap else None
        self.executor: Executor[ForwardInput, SamplerOutput]
        self._lanes: LaneExecutor[ForwardInput, SamplerOutput] | None = None
        if executor is not None:
            self.executor = executor
            self._lanes = executor if self._pipelined else None
        elif self._pipelined:
            self.executor = self._lanes = create_lane_executor(config, factory)
        else:
            self.executor = create_executor(config, factory)
        prefix_cache = config.cache.enable_prefix_cache
        if prefix_cache and self.model_config.has_linear_attention:
            logger.info(
                "prefix caching is off for %s: its linear-attention layers carry a state per "
                "sequence that cached KV blocks of a shared prefix do not restore",
                self.model_config.architecture,
            )
            prefix_cache = False
        self.block_manager = BlockManager(
            num_blocks=self.executor.num_blocks,
            block_size=config.cache.block_size,
            enable_prefix_cache=prefix_cache,
            sync=sync,
        )
        self.state_slots = self._state_slot_pool()
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.state_slots)
        self.inputs = InputProcessor(
            self.tokenizer,
            self.max_model_len,
            self.model_config.vocab_size,
            eos,
            self.block_manager,
            config.scheduler,
            self.structured_outputs,
        )
        self.outputs = OutputProcessor(self.tokenizer)
        self.sequences: dict[str, TokenSequence] = {}
        self.dead: str | None = None
        self._free_lanes = list(range(config.pipeline.max_concurrency))
        self._in_flight: deque[_InFlight] = deque()
        self._deferred_free: list[TokenSequence] = []
        # Set when a decode beside in-flight steps found no room: launch nothing more until
        # they drain, so the full path can preempt.
        self._draining = False
        self.idle = False
        self._last_progress = self._sync.monotonic()
        # When the oldest step still running started (None: none runs); /health reads it.
        self._busy_since: float | None = None
        # Outputs of requests failed while their batch was built, delivered with the step's.
        self._early: list[RequestOutput] = []
        self._num_launched_ahead = 0
        self._kv_fault = KvExhaustion(config.faults, self.block_manager)
        self.stats = EngineStats()
        self._publish_stats()
        logger.info(
            "engine ready: %s, context %d, %d KV blocks of %d tokens, %d state slots",
            self.model_config.architecture,
            self.max_model_len,
            self.block_manager.num_blocks,
            config.cache.block_size,
            self.state_slots.num_slots if self.state_slots is not None else 0,
        )

    def _state_slot_pool(self) -> StateSlotPool | None:
        """The linear-attention state slots of a hybrid model, as many as every worker has."""
        if not self.model_config.has_linear_attention:
            return None
        num_slots = self.executor.num_state_slots
        if num_slots < 1:
            raise ConfigError(
                f"{self.model_config.architecture} has linear-attention layers but the workers "
                "allocated no state slots for them"
            )
        return StateSlotPool(num_slots, self._sync)

    # -- requests -------------------------------------------------------------------------

    def add_sequence(self, seq: TokenSequence) -> None:
        """Add a request made by ``inputs.prepare``."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if seq.request_id in self.sequences:
            raise InvalidRequestError(f"request id {seq.request_id!r} is already in use")
        self.sequences[seq.request_id] = seq
        self.outputs.add(seq)
        self.scheduler.add(seq)
        self._publish_stats()

    def add_request(
        self, request_id: str | None, prompt: Prompt, params: SamplingParams | None = None
    ) -> str:
        seq = self.inputs.prepare(request_id, prompt, params or SamplingParams())
        self.add_sequence(seq)
        return seq.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.sequences.get(request_id)
        if seq is None:
            return None
        in_flight = request_id in self._busy_ids()
        self.scheduler.finish(seq, "abort", free_now=not in_flight)
        if in_flight:
            # Its step still writes the sequence's KV blocks and state slot: free them when it
            # completes.
            self._deferred_free.append(seq)
        out = self._finish_output(seq)
        self._publish_stats()
        return out

    def has_unfinished(self) -> bool:
        """Requests not finished yet, or steps still running (whose end frees what finished
        requests held)."""
        return bool(self.sequences) or bool(self._in_flight)

    def check_health(self) -> None:
        """Raise EngineDeadError if the engine died or a worker is gone (also while idle), and
        EngineUnhealthyError while a step has run past the health deadline (any thread)."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        since = self._busy_since
        limits = self.config.parallel
        if since is not None and self._sync.monotonic() - since > limits.health_timeout_s:
            raise EngineUnhealthyError(
                f"a step has been running for {self._sync.monotonic() - since:.0f} s, over "
                f"the {limits.health_timeout_s:g} s health deadline (it fails at "
                f"{limits.timeout_s:g} s)"
            )
        self.executor.check_health()

    def _publish_stats(self) -> None:
        self.stats = EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_steps_in_flight=len(self._in_flight),
            num_blocks=self.block_manager.num_blocks,
            num_free_blocks=self.block_manager.num_free_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps_launched_ahead=self._num_launched_ahead,
            num_state_slots=self.state_slots.num_slots if self.state_slots is not None else 0,
            num_free_state_slots=self.state_slots.num_free if self.state_slots is not None else 0,
        )

    # -- stepping -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One round of work: launch what can run and complete what is due. Afterwards
        ``idle`` says whether it did nothing at all (launched, completed and preempted
        nothing): then nothing changes until a request arrives or is aborted, and a caller
        should block instead of stepping again."""
        self.idle = False
        if self.dead is not None:
            return []
        self._kv_fault.before_step()
        outputs = self._step_pipelined() if self._pipelined else self._step_one()
        if self._early:
            outputs, self._early = self._early + outputs, []
            self.idle = False
        self._publish_stats()
        return outputs

    def _step_one(self) -> list[RequestOutput]:
        """One step at a time: schedule, run, process; or complete the step launched ahead
        while the previous one's outputs were processed."""
        if self._in_flight:
            flight = self._in_flight.popleft()
            return self._run_step(flight.out, lambda: self._wait_ahead(flight))
        sched_out = self._schedule_full()
        if sched_out.is_empty():
            self.idle = True
            return []
        fi = self._build(sched_out)
        if fi is None:
            return []
        self._busy_since = self._sync.monotonic()

        def run() -> SamplerOutput:
            try:
                return self.executor.execute(fi)
            finally:
                self._busy_since = None

        return self._run_step(sched_out, run)

    def _wait_ahead(self, flight: _InFlight) -> SamplerOutput:
        # The executor fails a step past the step timeout itself, naming the late ranks; this
        # is the backstop should it not answer at all.
        limit = 2 * self.config.parallel.timeout_s + STEP_TIMEOUT_GRACE_S
        left = flight.launched_at + limit - self._sync.monotonic()
        try:
            return flight.promise.result(timeout=max(left, 0.0))
        except TimeoutError:
            raise EngineDeadError(
                f"a step has run for over {limit:g} s without its workers answering"
            ) from None
        finally:
            self._busy_since = None
            self._release_deferred()

    def _launch_ahead(self, sampled: list[tuple[TokenSequence, int]]) -> None:
        """Launch the next step before the outputs of the one that just completed are
        processed, when it can only be every running sequence's next decode: its input is
        the tokens just sampled (already appended), and nothing the processing decides can
        change it, except that a request may end on a stop string, whose row is then wasted
        and whose blocks are freed when the step completes (like an abort's). Requests whose
        next input depends on that processing (grammars, penalties), waiting requests (the
        full path admits them) and tight KV space (the full path preempts) rule it out; so do
        requests that end here on a stop token or their length, which are left out."""
        sched = self.scheduler
        if self.dead is not None or self._launcher is None or len(sampled) != sched.num_running:
            return
        if sched.needs_full_step() or not sched.decodes_fit():
            return
        if any(seq.grammar is not None or seq.params.has_penalties for seq, _ in sampled):
            return
        ending = {seq.request_id for seq, _ in sampled if seq.check_stop_token() is not None}
        out = sched.schedule_decodes(exclude=ending, max_seqs=sched.config.max_seqs_per_batch)
        if out.is_empty():
            return
        fi = self._build(out)
        if fi is None:
            return
        promise = self._launcher.submit(lambda: self.executor.execute(fi))
        now = self._sync.monotonic()
        ids = frozenset(e.seq.request_id for e in out.scheduled)
        self._in_flight.append(_InFlight(0, out, promise, ids, False, now))
        self._busy_since = self._last_progress = now
        self._num_launched_ahead += 1

    def _build(self, out: SchedulerOutput) -> ForwardInput | None:
        """The batch's step input. A request whose part cannot be built fails alone (its
        output is delivered with the step's), and the rest run; None if none is left."""
        block_size = self.config.cache.block_size
        try:
            return build_forward_input(out, block_size)
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
            self._early.append(self._finish_output(entry.seq))
        if out.is_empty():
            return None
        return self._build(out)

    def _step_pipelined(self) -> list[RequestOutput]:
        """Keep up to ``max_concurrency`` steps in flight on the pipeline lanes, then complete
        the oldest. A step that admits, prefills or preempts runs alone; decode steps share
        the running sequences between lanes (disjoint sets, so results match one step at a
        time)."""
        self._launch()
        if not self._in_flight:
            self.idle = True
            return []
        flight = self._in_flight.popleft()
        timeout = self.config.parallel.timeout_s
        lanes = self._lanes
        assert lanes is not None

        def wait() -> SamplerOutput:
            left = flight.launched_at + timeout + STEP_TIMEOUT_GRACE_S - self._sync.monotonic()
            try:
                return flight.promise.result(timeout=max(left, 0.0))
            except TimeoutError:
                raise lanes.timed_out(flight.lane, timeout) from None
            finally:
                self._free_lanes.append(flight.lane)
                self._release_deferred()
                self._busy_since = self._in_flight[0].launched_at if self._in_flight else None

        return self._run_step(flight.out, wait)

    def _run_step(
        self, sched_out: SchedulerOutput, run: Callable[[], SamplerOutput]
    ) -> list[RequestOutput]:
        """The step's outputs, or its requests failed (all of them, if the engine died)."""
        try:
            result = run()
        except EngineDeadError as exc:
            # A step that failed on any rank leaves the devices in a state nothing vouches
            # for: the engine stops, every request fails with the cause, /health says so.
            logger.error("engine died: %s", exc)
            return self._fail_all(f"the engine failed: {exc}")
        except Exception as exc:
            logger.exception("a step failed")
            return self._fail_all(f"the engine failed: a step raised {describe(exc)}")
        finally:
            self._last_progress = self._sync.monotonic()
        self.scheduler.on_step_done(sched_out)
        return self._process(sched_out, result)

    def _schedule_full(self) -> SchedulerOutput:
        """The scheduler's full path (admits, prefills, preempts). A pass that only preempted
        is followed by another, which admits or runs what the preemption made room for: an
        empty result then means there is truly nothing to run."""
        out = self.scheduler.schedule()
        while out.is_empty() and out.preempted:
            self._last_progress = self._sync.monotonic()
            out = self.scheduler.schedule()
        return out

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
        width = self.config.pipeline.max_concurrency
        share = -(-self.scheduler.num_running // width)
        if self._in_flight:
            if self._draining:
                return SchedulerOutput(), False
            out = self.scheduler.schedule_decodes(exclude=self._busy_ids(), max_seqs=share)
            self._draining = out.blocked
            return out, False
        self._draining = False
        if not self.scheduler.needs_full_step() and self.scheduler.decodes_fit():
            return self.scheduler.schedule_decodes(exclude=set(), max_seqs=share), False
        return self._schedule_full(), True

    def _launch(self) -> None:
        while self._free_lanes and not any(f.exclusive for f in self._in_flight):
            out, exclusive = self._next_batch()
            if out.is_empty():
                return
            fi = self._build(out)
            if fi is None:
                continue
            lane = self._free_lanes.pop(0)
            try:
                assert self._lanes is not None
                promise = self._lanes.submit(lane, fi)
            except Exception as exc:  # noqa: BLE001 - becomes a failed step below
                promise = Promise(self._sync)
                promise.set_exception(exc)
            ids = frozenset(e.seq.request_id for e in out.scheduled)
            now = self._sync.monotonic()
            self._in_flight.append(_InFlight(lane, out, promise, ids, exclusive, now))
            self._last_progress = now
            if self._busy_since is None:
                self._busy_since = now

    def stalled_for(self) -> float:
        """Seconds since a step was last launched or completed (or a sequence preempted)."""
        return self._sync.monotonic() - self._last_progress

    def fail_stalled(self) -> list[RequestOutput]:
        """The watchdog's last resort, for an engine that has made no progress for
        ``stall_timeout_s`` with requests left: log the scheduler's state once and fail
        every request with an error that says so. A live engine never gets here, so the
        engine stops (a restart clears whatever leaked)."""
        state = self.scheduler_state()
        logger.error("the engine made no progress for %.1f s; %s", self.stalled_for(), state)
        message = (
            f"the engine could not schedule the request and gave up on it ({state}); this is "
            "a bug, please report it"
        )
        outputs = self._fail_all(message)
        self._last_progress = self._sync.monotonic()
        self._publish_stats()
        return outputs

    def scheduler_state(self) -> str:
        running = self.scheduler.running
        return (
            f"running {len(running)} (tokens to compute: "
            f"{[s.num_tokens - s.num_computed_tokens for s in running][:16]}), "
            f"waiting {self.scheduler.num_waiting}, in flight {len(self._in_flight)}, "
            f"free KV blocks {self.block_manager.num_free_blocks} of "
            f"{self.block_manager.num_blocks}"
            + (
                f", free state slots {self.state_slots.num_free} of {self.state_slots.num_slots}"
                if self.state_slots is not None
                else ""
            )
        )

    def _busy_ids(self) -> set[str]:
        """Requests with a step in flight."""
        return {rid for f in self._in_flight for rid in f.request_ids}

    def _release_deferred(self) -> None:
        busy = self._busy_ids()
        keep = []
        for seq in self._deferred_free:
            if seq.request_id in busy:
                keep.append(seq)
            else:
                self.scheduler.release(seq)
        self._deferred_free = keep

    def _process(self, sched_out: SchedulerOutput, result: SamplerOutput) -> list[RequestOutput]:
        if result.prompt_logprobs is not None:
            _record_prompt_logprobs(sched_out, result.prompt_logprobs)
        # The sampled tokens first: with them the next step can be launched (_launch_ahead)
        # while the rest (logprobs, text, stop strings, outputs) is done beside it.
        sampled: list[tuple[TokenSequence, int]] = []
        row = 0
        for entry in sched_out.scheduled:
            if not entry.samples:
                continue
            if entry.seq.status is SequenceStatus.RUNNING:
                entry.seq.token_ids.append(result.token_ids[row])
                sampled.append((entry.seq, row))
            row += 1
        if self._overlap:
            self._launch_ahead(sampled)
        busy = self._busy_ids()
        outputs: list[RequestOutput] = []
        for seq, row in sampled:
            token = seq.token_ids[-1]
            if seq.params.logprobs is not None and result.logprobs is not None:
                assert result.top_token_ids is not None and result.top_logprobs is not None
                n = seq.params.logprobs
                seq.logprobs.append(
                    TokenLogprobs(
                        token_id=token,
                        logprob=result.logprobs[row],
                        top=list(
                            zip(
                                result.top_token_ids[row][:n],
                                result.top_logprobs[row][:n],
                                strict=True,
                            )
                        ),
                    )
                )
            reason = self.outputs.on_token(seq) or seq.check_stop_token()
            if reason is None and seq.grammar is not None:
                reason = _advance_grammar(seq, token)
            if reason is not None:
                # A request ending on a stop string may be in the step launched ahead: its
                # blocks are freed when that step completes.
                in_flight = seq.request_id in busy
                self.scheduler.finish(seq, reason, error=seq.error, free_now=not in_flight)
                if in_flight:
                    self._deferred_free.append(seq)
                outputs.append(self._finish_output(seq))
            else:
                outputs.append(self.outputs.make_output(seq))
        return outputs

    def _finish_output(self, seq: TokenSequence) -> RequestOutput:
        self.sequences.pop(seq.request_id, None)
        return self.outputs.make_output(seq)

    def _fail_all(self, message: str) -> list[RequestOutput]:
        self.dead = message
        outputs = []
        for seq in list(self.sequences.values()):
            self.scheduler.finish(seq, "error", error=message)
            outputs.append(self._finish_output(seq))
        return outputs

    # -- conveniences ---------------------------------------------------------------------

    def generate(
        self, prompts: Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run ``prompts`` to completion; outputs in prompt order."""
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompts)
        else:
            param_list = list(params)
        if len(param_list) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        ids = [self.add_request(None, p, sp) for p, sp in zip(prompts, param_list, strict=True)]
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(ids):
            for out in self.step():
                if out.finished:
                    finished[out.request_id] = out
            if self.dead is not None and len(finished) < len(ids):
                raise EngineDeadError(self.dead)
            if self.idle and len(finished) < len(ids):
                # Offline nothing else can change the engine's state: waiting would never end.
                finished.update((o.request_id, o) for o in self.fail_stalled())
        # A step launched ahead may still run for requests that ended on a stop string.
        while self._in_flight and self.dead is None:
            self.step()
        return [finished[i] for i in ids]

    def shutdown(self) -> None:
        self.structured_outputs.shutdown()
        if self._launcher is not None:
            # A step still running past this ends when the executor shuts its workers down.
            self._launcher.stop(timeout=5.0)
        self.executor.shutdown()


def _advance_grammar(seq: TokenSequence, token: int) -> str | None:
    """Feed the sampled token to the request's grammar; a finish reason once the grammar is
    complete (nothing but EOS may follow) or broken."""
    assert seq.grammar is not None
    if not seq.grammar.accept(token):
        seq.error = f"the output left its grammar at token {token}: {seq.grammar.error}"
        logger.warning("request %s: %s", seq.request_id, seq.error)
        return "error"
    return "stop" if seq.grammar.is_finished else None


def _record_prompt_logprobs(sched_out: SchedulerOutput, scored: PromptLogprobs) -> None:
    at = 0
    for index, first, count in scored.spans:
        seq = sched_out.scheduled[index].seq
        # Equal unless the step raced an abort; never record a position twice.
        if first == len(seq.prompt_logprobs):
            n = seq.params.prompt_logprobs or 0
            seq.prompt_logprobs.extend(
                TokenLogprobs(
                    token_id=seq.prompt_token_ids[first + k],
                    logprob=scored.logprobs[at + k],
                    top=list(
                        zip(
                            scored.top_token_ids[at + k][:n],
                            scored.top_logprobs[at + k][:n],
                            strict=True,
                        )
                    ),
                    rank=scored.ranks[at + k],
                )
                for k in range(count)
            )
        at += count
