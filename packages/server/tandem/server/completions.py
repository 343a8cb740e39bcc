"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from tandem.core.llm.engine import Prompt
from tandem.core.llm.engine_loop import RequestStream
from tandem.core.llm.sequence import TokenLogprobs
from tandem.core.llm.tokenizer import Tokenizer
from tandem.server.common import (
    check_request,
    chunk_base,
    failure,
    new_id,
    now,
    stream_failure,
    usage,
)
from tandem.server.errors import ApiError
from tandem.server.generation import (
    Job,
    final_outputs,
    merge_outputs,
    sampling_params,
    submit_jobs,
)
from tandem.server.protocol import CompletionRequest
from tandem.server.sse import DONE, event
from tandem.server.state import ServerState


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


def legacy_logprobs(
    tokenizer: Tokenizer, entries: list[TokenLogprobs], text_offset: int
) -> dict[str, Any]:
    """The completions API's logprobs object for ``entries``, offsets from ``text_offset``."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_offset
    for entry in entries:
        text = tokenizer.token_text(entry.token_id)
        tokens.append(text)
        token_logprobs.append(entry.logprob)
        top = {tokenizer.token_text(t): lp for t, lp in entry.top}
        top.setdefault(text, entry.logprob)
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


async def create_completion(state: ServerState, body: CompletionRequest) -> Any:
    check_request(state, body)
    if body.echo and body.logprobs is not None:
        raise ApiError(
            400, "echo together with logprobs is not supported yet; drop one.", param="echo"
        )
    prompts = _prompts(body)
    tokenizer = state.engine.tokenizer
    jobs = [
        Job(
            index=p * body.n + c,
            prompt=prompt,
            params=sampling_params(body, body.max_tokens or 16, body.logprobs, choice=c),
        )
        for p, prompt in enumerate(prompts)
        for c in range(body.n)
    ]
    echoes = [
        (prompt if isinstance(prompt, str) else tokenizer.decode(prompt)) if body.echo else ""
        for prompt in prompts
        for _ in range(body.n)
    ]
    request_id = new_id("cmpl")
    streams = submit_jobs(state, jobs, request_id)
    created = now()
    if body.stream:
        return StreamingResponse(
            _stream(state, body, jobs, streams, echoes, request_id, created),
            media_type="text/event-stream",
        )
    outputs = await final_outputs(state, jobs, streams)
    failed = failure(outputs)
    if failed is not None:
        return JSONResponse(failed[1], status_code=failed[0])
    choices = []
    for job, out, echo in zip(jobs, outputs, echoes, strict=True):
        logprobs = None
        if body.logprobs is not None and out.logprobs is not None:
            logprobs = legacy_logprobs(tokenizer, out.logprobs, len(echo))
        choices.append(
            {
                "index": job.index,
                "text": echo + out.text,
                "logprobs": logprobs,
                "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason,
            }
        )
    prompt_tokens = sum(len(outputs[p * body.n].prompt_token_ids) for p in range(len(prompts)))
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": state.served_model_name,
        "choices": choices,
        "usage": usage(prompt_tokens, sum(len(o.token_ids) for o in outputs)),
    }


async def _stream(
    state: ServerState,
    body: CompletionRequest,
    jobs: list[Job],
    streams: list[RequestStream],
    echoes: list[str],
    request_id: str,
    created: int,
) -> AsyncGenerator[str, None]:
    tokenizer = state.engine.tokenizer
    base = chunk_base(state, request_id, "text_completion", created)
    offsets = [len(e) for e in echoes]
    prompt_tokens: dict[int, int] = {}
    completion_tokens = 0
    for job, echo in zip(jobs, echoes, strict=True):
        if echo:
            choice = {"index": job.index, "text": echo, "logprobs": None, "finish_reason": None}
            yield event({**base, "choices": [choice]})
    async for index, out in merge_outputs(state, jobs, streams):
        failed = stream_failure(out)
        if failed is not None:
            yield event(failed)
            break
        logprobs = None
        if body.logprobs is not None and out.new_logprobs:
            logprobs = legacy_logprobs(tokenizer, out.new_logprobs, offsets[index])
        offsets[index] += len(out.delta_text)
        if out.delta_text or logprobs is not None or out.finished:
            choice = {
                "index": index,
                "text": out.delta_text,
                "logprobs": logprobs,
                "finish_reason": out.finish_reason if out.finished else None,
            }
            if out.finished:
                choice["stop_reason"] = out.stop_reason
            yield event({**base, "choices": [choice]})
        if out.finished:
            prompt_tokens[index // body.n] = len(out.prompt_token_ids)
            completion_tokens += len(out.token_ids)
    else:
        if body.stream_options is not None and body.stream_options.include_usage:
            yield event(
                {
                    **base,
                    "choices": [],
                    "usage": usage(sum(prompt_tokens.values()), completion_tokens),
                }
            )
    yield DONE
