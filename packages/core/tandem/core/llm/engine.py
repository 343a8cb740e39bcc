"""LLMEngine: requests in, one scheduled step at a time through the executor, outputs out.

Each step: the stepping mode schedules, builds and launches what can run and hands back the
step due; the engine waits for it and turns its sampled tokens into outputs. Requests are
prepared by ``inputs`` (``input_processor.py``) on any thread. Not thread-safe otherwise;
``EngineLoop`` drives it from one thread for servers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from pathlib import Path

from tandem.core.config import EngineConfig
from tandem.core.errors import ConfigError, EngineDeadError, InvalidRequestError
from tandem.core.executor.executor import LaneExecutor
from tandem.core.failure_text import describe
from tandem.core.faults import KvExhaustion
from tandem.core.kv.block_manager import BlockManager
from tandem.core.kv.state_slots import StateSlotPool
from tandem.core.kv.state_snapshots import StateSnapshotCache
from tandem.core.llm.drafting import Drafter
from tandem.core.llm.forward_input import ForwardInput, SamplerOutput
from tandem.core.llm.in_flight import InFlightSteps
from tandem.core.llm.input_processor import InputProcessor, Prompt, eos_token_ids
from tandem.core.llm.model_runner import LLMRunnerFactory
from tandem.core.llm.output_processor import OutputProcessor
from tandem.core.llm.outputs import RequestOutput
from tandem.core.llm.sampling_params import SamplingParams
from tandem.core.llm.sampling_rows import SamplingRows
from tandem.core.llm.scheduler import Scheduler, SchedulerOutput
from tandem.core.llm.sequence import TokenSequence
from tandem.core.llm.spec_decode_stats import SpecDecodeStats
from tandem.core.llm.stall_watch import StallWatch
from tandem.core.llm.stats import EngineStats
from tandem.core.llm.step_results import (
    AcceptedDrafts,
    accept_drafts,
    advance_grammar,
    append_sampled,
    failed_rows,
    record_logprobs,
    record_prompt_logprobs,
)
from tandem.core.llm.stepping import DueStep, StepParts, pick_stepping, step_executor
from tandem.core.llm.structured_output import StructuredOutputs
from tandem.core.llm.tokenizer import Tokenizer
from tandem.device.sync import REAL_SYNC, Sync

logger = logging.getLogger(__name__)


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
        spec = config.speculative
        if spec is not None and spec.drafts_with_head:
            # Before any worker builds a model without the head it needs.
            self._check_head()
        self.tokenizer = Tokenizer(folder)
        limit = self.model_config.max_position_embeddings
        self.max_model_len = min(config.model.max_model_len or limit, limit)
        eos = eos_token_ids(self.model_config, self.tokenizer)
        self.structured_outputs = StructuredOutputs(
            self.tokenizer, self.model_config.vocab_size, eos, config.structured_output
        )
        make_stepper = pick_stepping(config, sync)
        self.executor, lanes = step_executor(config, factory, executor)
        self.block_manager = BlockManager(
            num_blocks=self.executor.num_blocks,
            block_size=config.cache.block_size,
            enable_prefix_cache=self._prefix_cache(),
            sync=sync,
        )
        self.state_slots = self._state_slot_pool()
        self.snapshots = self._snapshot_cache()
        # The logits processors' slots of the sequences that sample (logits_processor.py).
        self.sampling_rows = SamplingRows(config.scheduler.max_seqs_per_batch)
        drafter = self._drafter()
        self.spec_stats = (
            SpecDecodeStats(drafter.config.num_speculative_tokens) if drafter is not None else None
        )
        self.scheduler = Scheduler(
            config.scheduler,
            self.block_manager,
            self.state_slots,
            drafter=drafter,
            snapshots=self.snapshots,
            snapshot_interval=config.cache.state_snapshot_interval,
            state_scratch=self._state_scratch(),
        )
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
        self.idle = False
        self.in_flight = InFlightSteps(self.scheduler)
        self.watch = StallWatch(config.parallel, self.scheduler, self.in_flight, sync)
        # Outputs of requests failed while their batch was built, delivered with the step's.
        self._early: list[RequestOutput] = []
        self.stepper = make_stepper(
            StepParts(
                config,
                self.scheduler,
                self.executor,
                lanes,
                self.in_flight,
                self.watch,
                self.sampling_rows,
                sync,
                lambda seq: self._early.append(self._finish_output(seq)),
            )
        )
        self._kv_fault = KvExhaustion(config.faults, self.block_manager)
        self._publish_stats()
        logger.info(
            "engine ready: %s, context %d, %d KV blocks of %d tokens, %d state slots",
            self.model_config.architecture,
            self.max_model_len,
            self.block_manager.num_blocks,
            config.cache.block_size,
            self.state_slots.num_slots if self.state_slots is not None else 0,
        )

    def _prefix_cache(self) -> bool:
        cache = self.config.cache
        hybrid = self.model_config.has_linear_attention
        if cache.enable_prefix_cache and hybrid and self.executor.num_state_snapshots == 0:
            # Asked for with --state-cache-mb 0; a warning when memory left no room.
            asked = cache.state_cache_mb is not None
            logger.log(
                logging.INFO if asked else logging.WARNING,
                "prefix caching is off for %s: its linear-attention layers need a state "
                "snapshot where a cached prefix ends, and %s",
                self.model_config.architecture,
                "--state-cache-mb is 0"
                if asked
                else "the state's share of the cache memory has no room for one beside the "
                "slots (and their scratch rows for speculative drafts)",
            )
            return False
        return cache.enable_prefix_cache

    def _snapshot_cache(self) -> StateSnapshotCache | None:
        """The linear-attention state snapshots of a hybrid model's prefix cache: the rows of
        every state pool after the slots."""
        if self.state_slots is None or not self.block_manager.enable_prefix_cache:
            return None
        first = self.state_slots.num_slots + 1
        num = self.executor.num_state_snapshots
        logger.info(
            "prefix caching for %s: %d linear-attention state snapshots (--state-cache-mb), "
            "at prompt ends, sequence ends, shared prefixes and every %d tokens of long prefills",
            self.model_config.architecture,
            num,
            self.config.cache.state_snapshot_interval,
        )
        return StateSnapshotCache(
            range(first, first + num),
            self.config.cache.block_size,
            release_block=self.block_manager.release_block,
            is_cached=self.block_manager.is_cached,
            ref_count=self.block_manager.ref_count,
            sync=self._sync,
        )

    def _drafter(self) -> Drafter | None:
        """Speculative decoding's drafter, if asked for and served with this model and
        configuration (anything else is refused, never run silently wrong)."""
        spec = self.config.speculative
        if spec is None:
            return None
        if spec.drafts_with_head:
            logger.info(
                "speculative decoding: up to %d draft token(s) a step from the checkpoint's "
                "multi-token-prediction head",
                spec.num_speculative_tokens,
            )
        else:
            logger.info(
                "speculative decoding: %s, %d tokens, n-grams of %d to %d tokens",
                spec.method,
                spec.num_speculative_tokens,
                spec.prompt_lookup_min,
                spec.prompt_lookup_max,
            )
        return Drafter(spec, uses_processor=self.sampling_rows.uses_processor)

    def _state_slot_pool(self) -> StateSlotPool | None:
        """The linear-attention state slots of a hybrid model, as many as every worker has."""
        num_slots = self.executor.num_state_slots
        if not self.model_config.has_linear_attention:
            if num_slots > 0:
                # Without a pool every sequence would share slot 0's recurrent state.
                raise ConfigError(
                    f"the {self.model_config.architecture} model has linear-attention layers "
                    "(linear_attention_layers()) but its config does not say so: its "
                    "parse_config must return a config whose has_linear_attention is True"
                )
            return None
        if num_slots < 1:
            raise ConfigError(
                f"{self.model_config.architecture} has linear-attention layers but the workers "
                "allocated no state slots for them"
            )
        return StateSlotPool(num_slots, self._sync)

    def _check_head(self) -> None:
        """What the "mtp" method needs: a head in the checkpoint."""
        flag = "--speculative-config"
        if self.model_config.mtp_layers < 1:
            raise ConfigError(
                f"{flag}: method 'mtp' drafts with the checkpoint's multi-token-prediction "
                f"head, and this {self.model_config.architecture} checkpoint has none "
                "(config.json has no mtp_num_hidden_layers); use method 'ngram'"
            )

    def _state_scratch(self) -> range | None:
        """The state rows where verifying sequences keep their states position by position
        (hybrid models with speculative decoding): ``num_speculative_tokens`` per slot, after
        the slots and the snapshots (kv/cache_sizing.py)."""
        spec = self.config.speculative
        if self.state_slots is None or spec is None:
            return None
        first = 1 + self.state_slots.num_slots + self.executor.num_state_snapshots
        return range(first, first + self.state_slots.num_slots * spec.num_speculative_tokens)

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
        self.in_flight.finish(seq, "abort")
        out = self._finish_output(seq)
        self._publish_stats()
        return out

    def has_unfinished(self) -> bool:
        """Requests not finished yet, or steps still running (whose end frees what finished
        requests held)."""
        return bool(self.sequences) or bool(self.in_flight)

    def check_health(self) -> None:
        """Raise EngineDeadError if the engine died or a worker is gone (also while idle), and
        EngineUnhealthyError while a step has run past the health deadline (any thread)."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        self.watch.check_busy()
        self.executor.check_health()

    def _publish_stats(self) -> None:
        in_flight = self.in_flight
        # Replaced, never mutated: other threads read it whole.
        self.stats = EngineStats.of(
            self.scheduler, len(in_flight), in_flight.num_launched_ahead, self.spec_stats
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
        due = self.stepper.next_step()
        self.idle = due is None
        outputs = [] if due is None else self._complete(due)
        if self._early:
            outputs, self._early = self._early + outputs, []
            self.idle = False
        self._publish_stats()
        return outputs

    def _complete(self, due: DueStep) -> list[RequestOutput]:
        """The step's outputs, or its requests failed (all of them, if the engine died)."""
        try:
            result = due.wait()
        except EngineDeadError as exc:
            # A step that failed on any rank leaves the devices in a state nothing vouches
            # for: the engine stops, every request fails with the cause, /health says so.
            logger.error("engine died: %s", exc)
            return self._fail_all(f"the engine failed: {exc}")
        except Exception as exc:
            logger.exception("a step failed")
            return self._fail_all(f"the engine failed: a step raised {describe(exc)}")
        finally:
            self.watch.progressed()
        # Before anything reads the step's tokens: a failed row's is not to be used.
        failed = [self._fail_request(seq, error) for seq, error in failed_rows(due.out, result)]
        drafts = AcceptedDrafts()
        if self.spec_stats is not None:
            drafts = accept_drafts(due.out, result, self.spec_stats)
        self.scheduler.on_step_done(due.out)
        return failed + self._process(due.out, result, drafts)

    def _fail_request(self, seq: TokenSequence, error: str) -> RequestOutput:
        """End one request whose logits processor failed; the engine serves on."""
        logger.error("request %s failed: %s", seq.request_id, error)
        self.in_flight.finish(seq, "error", error=error)
        return self._finish_output(seq)

    def _process(
        self, sched_out: SchedulerOutput, result: SamplerOutput, drafts: AcceptedDrafts
    ) -> list[RequestOutput]:
        if result.prompt_logprobs is not None:
            record_prompt_logprobs(sched_out, result.prompt_logprobs)
        # The sampled tokens first: with them the next step can be launched while the rest
        # (logprobs, text, stop strings, outputs) is done beside it.
        sampled = append_sampled(sched_out, result, drafts.ended)
        self.stepper.on_sampled(sampled)
        busy = self.in_flight.busy_ids()
        outputs: list[RequestOutput] = []
        for seq, row in sampled:
            record_logprobs(seq, row, result)
            rid = seq.request_id
            new = drafts.appended.get(rid, 0) + (0 if rid in drafts.ended else 1)
            reason = self.outputs.on_tokens(seq, new) or seq.check_stop_token()
            if reason is None and seq.grammar is not None:
                reason = advance_grammar(seq, seq.token_ids[-1])
            if reason is None:
                outputs.append(self.outputs.make_output(seq))
                continue
            # A request ending on a stop string may be in the step launched ahead: its
            # blocks are freed when that step completes.
            self.in_flight.finish(seq, reason, error=seq.error, busy=busy)
            outputs.append(self._finish_output(seq))
        return outputs

    def fail_stalled(self) -> list[RequestOutput]:
        """The watchdog's last resort, for an engine that has made no progress for
        ``stall_timeout_s`` with requests left: log the scheduler's state once and fail
        every request with an error that says so. A live engine never gets here, so the
        engine stops (a restart clears whatever leaked)."""
        outputs = self._fail_all(self.watch.give_up())
        self.watch.progressed()
        self._publish_stats()
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
        while self.in_flight and self.dead is None:
            self.step()
        return [finished[i] for i in ids]

    def shutdown(self) -> None:
        spec = self.spec_stats
        if spec is not None:
            logger.info(
                "speculative decoding: %d drafts, %d draft tokens, %d accepted (by position: %s)",
                spec.num_drafts,
                spec.num_draft_tokens,
                spec.num_accepted_tokens,
                ", ".join(str(n) for n in spec.accepted_per_position),
            )
        self.structured_outputs.shutdown()
        self.stepper.shutdown()
        self.executor.shutdown()
