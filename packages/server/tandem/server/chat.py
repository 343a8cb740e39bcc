"""POST /v1/chat/completions: messages rendered by the model's chat template."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from tandem.core import InvalidRequestError
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
from tandem.server.protocol import ChatCompletionRequest
from tandem.server.sse import DONE, event
from tandem.server.state import ServerState


def _token_entry(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprobs]) -> dict[str, Any]:
    return {
        "content": [
            {
                **_token_entry(tokenizer, e.token_id, e.logprob),
                "top_logprobs": [_token_entry(tokenizer, t, lp) for t, lp in e.top],
            }
            for e in entries
        ]
    }


def _prompt_ids(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    tokenizer = state.engine.tokenizer
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    text = tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=body.add_generation_prompt,
        **(body.chat_template_kwargs or {}),
    )
    # The template writes the special tokens itself.
    return tokenizer.encode(text, add_special_tokens=False)


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest) -> Any:
    check_request(state, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs=true.", param="top_logprobs")
    prompt_ids = _prompt_ids(state, body)
    max_model_len = state.engine.max_model_len
    if len(prompt_ids) >= max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens, but the messages "
            f"take {len(prompt_ids)} tokens; shorten them.",
            param="messages",
        )
    max_tokens = body.max_completion_tokens or body.max_tokens or max_model_len - len(prompt_ids)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    jobs = [
        Job(index=c, prompt=prompt_ids, params=sampling_params(body, max_tokens, logprobs, c))
        for c in range(body.n)
    ]
    request_id = new_id("chatcmpl")
    streams = submit_jobs(state, jobs, request_id)
    created = now()
    if body.stream:
        return StreamingResponse(
            _stream(state, body, jobs, streams, request_id, created),
            media_type="text/event-stream",
        )
    outputs = await final_outputs(state, jobs, streams)
    failed = failure(outputs)
    if failed is not None:
        return JSONResponse(failed[1], status_code=failed[0])
    tokenizer = state.engine.tokenizer
    choices = [
        {
            "index": job.index,
            "message": {"role": "assistant", "content": out.text},
            "logprobs": chat_logprobs(tokenizer, out.logprobs or []) if body.logprobs else None,
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
        }
        for job, out in zip(jobs, outputs, strict=True)
    ]
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": state.served_model_name,
        "choices": choices,
        "usage": usage(len(prompt_ids), sum(len(o.token_ids) for o in outputs)),
    }


async def _stream(
    state: ServerState,
    body: ChatCompletionRequest,
    jobs: list[Job],
    streams: list[RequestStream],
    request_id: str,
    created: int,
) -> AsyncGenerator[str, None]:
    tokenizer = state.engine.tokenizer
    base = chunk_base(state, request_id, "chat.completion.chunk", created)
    for job in jobs:
        first = {
            "index": job.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        yield event({**base, "choices": [first]})
    prompt_tokens = 0
    completion_tokens = 0
    async for index, out in merge_outputs(state, jobs, streams):
        failed = stream_failure(out)
        if failed is not None:
            yield event(failed)
            break
        logprobs = None
        if body.logprobs and out.new_logprobs:
            logprobs = chat_logprobs(tokenizer, out.new_logprobs)
        if out.delta_text or logprobs is not None:
            choice = {
                "index": index,
                "delta": {"content": out.delta_text},
                "logprobs": logprobs,
                "finish_reason": None,
            }
            yield event({**base, "choices": [choice]})
        if out.finished:
            final = {
                "index": index,
                "delta": {},
                "logprobs": None,
                "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason,
            }
            yield event({**base, "choices": [final]})
            prompt_tokens = len(out.prompt_token_ids)
            completion_tokens += len(out.token_ids)
    else:
        if body.stream_options is not None and body.stream_options.include_usage:
            yield event({**base, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
    yield DONE
