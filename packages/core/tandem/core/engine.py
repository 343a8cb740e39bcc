"""LLMEngine: requests in, one scheduled step at a time through the executor, outputs out.

Not thread-safe on its own; ``EngineLoop`` drives it from one thread for servers.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence as Seq
from pathlib import Path

from tandem.core.block_manager import BlockManager
from tandem.core.config import EngineConfig
from tandem.core.errors import EngineDeadError, InvalidRequestError
from tandem.core.executor import Executor, create_executor
from tandem.core.forward_input import SamplerOutput
from tandem.core.input_builder import build_forward_input
from tandem.core.models.model_config import ModelConfig
from tandem.core.models.registry import model_class
from tandem.core.output_processor import OutputProcessor
from tandem.core.outputs import RequestOutput
from tandem.core.sampling_params import SamplingParams
from tandem.core.scheduler import Scheduler, SchedulerOutput
from tandem.core.sequence import Sequence, SequenceStatus, TokenLogprobs
from tandem.core.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Prompt = str | list[int]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        folder = Path(config.model.model)
        self.model_config = ModelConfig.from_folder(folder)
        model_class(self.model_config.architecture)  # unknown architectures fail before workers
        self.tokenizer = Tokenizer(folder)
        limit = self.model_config.max_position_embeddings
        self.max_model_len = min(config.model.max_model_len or limit, limit)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.executor: Executor = create_executor(config, self.model_config)
        self.block_manager = BlockManager(
            num_blocks=self.executor.num_blocks,
            block_size=config.cache.block_size,
            enable_prefix_cache=config.cache.enable_prefix_cache,
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.outputs = OutputProcessor(self.tokenizer)
        self.sequences: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.dead: str | None = None
        logger.info(
            "engine ready: %s, context %d, %d KV blocks of %d tokens",
            self.model_config.architecture,
            self.max_model_len,
            self.block_manager.num_blocks,
            config.cache.block_size,
        )

    # -- requests -------------------------------------------------------------------------

    def prepare_request(
        self, request_id: str | None, prompt: Prompt, params: SamplingParams
    ) -> Sequence:
        """Validate and tokenize a request without touching engine state (any thread)."""
        params.validate()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = list(prompt)
            vocab = self.model_config.vocab_size
            bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(
                    f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}",
                    param="prompt",
                )
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_ids)} tokens, but this model's maximum context "
                f"length is {self.max_model_len} tokens (prompt plus at least one generated "
                "token); shorten the prompt",
                param="prompt",
            )
        total = min(len(prompt_ids) + params.max_tokens, self.max_model_len)
        # The last sampled token is never fed back, so its KV is never stored.
        blocks = self.block_manager.blocks_for(total - 1)
        if blocks > self.block_manager.num_blocks:
            capacity = self.block_manager.num_blocks * self.block_manager.block_size
            raise InvalidRequestError(
                f"the request needs {total} tokens of KV cache (prompt {len(prompt_ids)} + "
                f"max_tokens {params.max_tokens}), more than the whole cache holds "
                f"({capacity} tokens); lower max_tokens or give the cache more memory",
                param="max_tokens",
            )
        sched = self.config.scheduler
        if not sched.enable_chunked_prefill and len(prompt_ids) > sched.max_tokens_per_batch:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_ids)} tokens, more than max_tokens_per_batch "
                f"({sched.max_tokens_per_batch}) without chunked prefill; enable chunked "
                "prefill or raise --max-tokens-per-batch",
                param="prompt",
            )
        return Sequence(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            params=params,
            eos_token_ids=self.eos_token_ids,
            max_total_tokens=self.max_model_len,
        )

    def add_sequence(self, seq: Sequence) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead}")
        if seq.request_id in self.sequences:
            raise InvalidRequestError(f"request id {seq.request_id!r} is already in use")
        self.sequences[seq.request_id] = seq
        self.outputs.add(seq)
        self.scheduler.add(seq)

    def add_request(
        self, request_id: str | None, prompt: Prompt, params: SamplingParams | None = None
    ) -> str:
        seq = self.prepare_request(request_id, prompt, params or SamplingParams())
        self.add_sequence(seq)
        return seq.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.sequences.get(request_id)
        if seq is None:
            return None
        self.scheduler.finish(seq, "abort")
        return self._finish_output(seq)

    def has_unfinished(self) -> bool:
        return bool(self.sequences)

    # -- stepping -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.dead is not None:
            return []
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty():
            return []
        fi = build_forward_input(sched_out, self.config.cache.block_size)
        try:
            result = self.executor.execute_model(fi)
        except EngineDeadError as exc:
            logger.error("engine died: %s", exc)
            return self._fail_all(str(exc))
        except Exception as exc:
            logger.exception("step failed; failing the %d requests in it", len(sched_out.scheduled))
            return self._fail_step(sched_out, f"the model step failed: {exc}")
        self.scheduler.on_step_done(sched_out)
        return self._process(sched_out, result)

    def _process(self, sched_out: SchedulerOutput, result: SamplerOutput) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        row = 0
        for entry in sched_out.scheduled:
            seq = entry.seq
            if not entry.samples:
                continue
            token = result.token_ids[row]
            if seq.status is SequenceStatus.RUNNING:
                seq.token_ids.append(token)
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
                if reason is not None:
                    self.scheduler.finish(seq, reason)
                    outputs.append(self._finish_output(seq))
                else:
                    outputs.append(self.outputs.make_output(seq))
            row += 1
        return outputs

    def _finish_output(self, seq: Sequence) -> RequestOutput:
        self.sequences.pop(seq.request_id, None)
        return self.outputs.make_output(seq)

    def _fail_step(self, sched_out: SchedulerOutput, message: str) -> list[RequestOutput]:
        outputs = []
        for entry in sched_out.scheduled:
            if entry.seq.request_id in self.sequences:
                self.scheduler.finish(entry.seq, "error", error=message)
                outputs.append(self._finish_output(entry.seq))
        return outputs

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
        return [finished[i] for i in ids]

    def shutdown(self) -> None:
        self.executor.shutdown()
