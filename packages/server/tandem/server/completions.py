"""POST /v1/completions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from tandem.core import RequestOutput
from tandem.core.llm.input_processor import Prompt, PromptEncoder
from tandem.core.llm.sequence import TokenLogprobs
from tandem.server.common import check_request, new_id, usage
from tandem.server.endpoint import StreamShape, respond
from tandem.server.errors import ApiError
from tandem.server.generation import Job, sampling_params
from tandem.server.logprobs import TokenNames, generated, legacy_logprobs, prompt_logprobs_json
from tandem.server.preparer import PREPARED_SCOPE_KEY
from tandem.server.protocol import CompletionRequest
from tandem.server.state import ServerState
from tandem.server.structured_outputs import compile_grammar, structured_output_spec

if TYPE_CHECKING:
    pass


def _prompts(body: CompletionRequest) -> list[Prompt]:
    prompt = body.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt must not be empty.", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [[p for p in prompt if isinstance(p, int)]]
    out: list[Prompt] = []
    for p in prompt:
        if isinstance(p, int):
            raise ApiError(400, "prompt mixes token ids and lists of token ids.", param="prompt")
        out.append(p if isinstance(p, str) else list(p))
    if any(not p for p in out):
        raise ApiError(400, "prompt must not contain empty prompts.", param="prompt")
    return out


def check_completion(state: ServerState, body: CompletionRequest) -> list[Prompt]:
    """What is refused before any work (the same wherever the request is prepared): the
    model, the budgets, the fields that contradict one another, the prompts' shape, the
    grammar's form; the prompts otherwise."""
    check_request(state, body)
    requested = 16 if body.max_tokens is None else body.max_tokens
    if requested == 0 and not body.echo:
        raise ApiError(400, "max_tokens must be at least 1 (0 only with echo).", param="max_tokens")
    if body.prompt_logprobs is not None and body.stream:
        raise ApiError(
            400, "prompt_logprobs are not available with stream=true.", param="prompt_logprobs"
        )
    prompts = _prompts(body)
    structured_output_spec(body)
    return prompts


def tokenize_prompts(
    inputs: PromptEncoder, prompts: list[Prompt], echo: bool
) -> tuple[list[list[int]], list[str]]:
    """Each prompt's ids (text tokenized once for all n choices, after a size check) and its
    echo: slow for long inputs, so never on the event loop (a preparation process runs it
    for a large body)."""
    ids = []
    for prompt in prompts:
        if isinstance(prompt, str):
            ids.append(inputs.encode_prompt(prompt))
        else:
            inputs.check_prompt_length(len(prompt))
            ids.append(prompt)
    echoes = [
        (p if isinstance(p, str) else inputs.tokenizer.decode(i)) if echo else ""
        for p, i in zip(prompts, ids, strict=True)
    ]
    return ids, echoes


async def create_completion(
    state: ServerState, body: CompletionRequest, request: Request | None = None
) -> Any:
    prompts = check_completion(state, body)
    requested = 16 if body.max_tokens is None else body.max_tokens
    spec = structured_output_spec(body)
    shape = _Shape(
        body=body,
        names=TokenNames(state.engine.tokenizer, body.return_tokens_as_token_ids),
        # echo with logprobs returns the prompt's logprobs too, as vLLM does.
        score_prompt=body.echo and body.logprobs is not None,
        echo_only=requested == 0,
    )
    prompt_logprobs = body.prompt_logprobs
    if prompt_logprobs is None and shape.score_prompt:
        prompt_logprobs = body.logprobs
    inputs = state.engine.inputs

    # A large body was prepared in a preparation process (preparer.py) before it got here,
    # and arrives with a stand-in for its prompts.
    prepared = None if request is None else request.scope.get(PREPARED_SCOPE_KEY)
    if prepared is not None:
        prompt_ids, prompt_echoes = prepared
    else:
        prompt_ids, prompt_echoes = await state.preparer.run(
            lambda: tokenize_prompts(inputs, prompts, body.echo)
        )
    # After the prompts, as for chat: the same errors first wherever a request is prepared.
    if spec is not None:
        await compile_grammar(state, spec)
    # Nothing to generate still takes one step: the one that computes the prompt.
    max_tokens = max(requested, 1)
    jobs = [
        Job(
            index=p * body.n + c,
            prompt=ids,
            params=sampling_params(
                body, max_tokens, body.logprobs, c, prompt_logprobs, structured_output=spec
            ),
        )
        for p, ids in enumerate(prompt_ids)
        for c in range(body.n)
    ]
    shape.echoes = [echo for echo in prompt_echoes for _ in range(body.n)]
    request_id = new_id("cmpl")

    def complete(outputs: list[RequestOutput], created: int) -> dict[str, Any]:
        choices = [shape.choice(job.index, out) for job, out in zip(jobs, outputs, strict=True)]
        prompt_tokens = sum(
            len(outputs[p * body.n].prompt_token_ids) for p in range(len(prompt_ids))
        )
        generated_tokens = 0 if shape.echo_only else sum(len(o.token_ids) for o in outputs)
        return {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": state.served_model_name,
            "choices": choices,
            "usage": usage(prompt_tokens, generated_tokens),
        }

    stream = shape.stream(jobs) if body.stream else None
    return await respond(state, jobs, request_id, stream, complete, request)


@dataclass
class _Shape:
    """How one request's outputs become choices: echo, logprobs, prompt logprobs."""

    body: CompletionRequest
    names: TokenNames
    score_prompt: bool
    echo_only: bool
    echoes: list[str] = field(default_factory=list)

    def _entries(
        self, out: RequestOutput, generated_part: list[TokenLogprobs], with_prompt: bool
    ) -> list[tuple[int, TokenLogprobs | None]]:
        entries: list[tuple[int, TokenLogprobs | None]] = []
        if with_prompt:
            entries += zip(out.prompt_token_ids, out.prompt_logprobs or [], strict=True)
        if not self.echo_only:
            entries += generated(generated_part)
        return entries

    def choice(self, index: int, out: RequestOutput) -> dict[str, Any]:
        echo = self.echoes[index]
        logprobs = None
        if self.body.logprobs is not None:
            entries = self._entries(out, out.logprobs or [], self.score_prompt)
            logprobs = legacy_logprobs(self.names, entries, 0 if self.score_prompt else len(echo))
        choice = {
            "index": index,
            "text": echo + ("" if self.echo_only else out.text),
            "logprobs": logprobs,
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
        }
        if self.body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(
                self.names.tokenizer, out.prompt_logprobs or []
            )
        return choice

    def stream(self, jobs: list[Job]) -> StreamShape:
        # Where the next token's text starts, counted in token texts as the final body does.
        offsets = [0 if self.score_prompt else len(e) for e in self.echoes]
        started: set[int] = set()

        def chunks(index: int, out: RequestOutput) -> list[dict[str, Any]]:
            text = "" if self.echo_only else out.delta_text
            first = self.score_prompt and index not in started
            if first:
                # The echo waits for the prompt's logprobs, which come with the first output.
                started.add(index)
                text = self.echoes[index] + text
            logprobs = None
            entries = self._entries(out, out.new_logprobs, with_prompt=first)
            if self.body.logprobs is not None and entries:
                logprobs = legacy_logprobs(self.names, entries, offsets[index])
                offsets[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
            if not (text or logprobs is not None or out.finished):
                return []
            choice: dict[str, Any] = {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": out.finish_reason if out.finished else None,
            }
            if out.finished:
                choice["stop_reason"] = out.stop_reason
            return [choice]

        opening = [
            {"index": job.index, "text": echo, "logprobs": None, "finish_reason": None}
            for job, echo in zip(jobs, self.echoes, strict=True)
            if echo and not self.score_prompt
        ]
        body = self.body
        return StreamShape(
            obj="text_completion",
            opening=opening,
            chunks=chunks,
            prompt_of=lambda index: index // body.n,
            include_usage=body.stream_options is not None and body.stream_options.include_usage,
        )
