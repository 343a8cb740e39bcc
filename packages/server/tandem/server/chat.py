"""POST /v1/chat/completions: messages rendered by the model's chat template."""

from __future__ import annotations

from typing import Any

from tandem.core import RequestOutput
from tandem.core.llm.sequence import TokenLogprobs
from tandem.core.llm.tokenizer import Tokenizer
from tandem.server.common import check_request, new_id, usage
from tandem.server.endpoint import StreamShape, respond
from tandem.server.errors import ApiError
from tandem.server.generation import Job, sampling_params
from tandem.server.protocol import ChatCompletionRequest
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
    state.engine.check_prompt_length(len(prompt_ids), param="messages")
    max_model_len = state.engine.max_model_len
    max_tokens = body.max_completion_tokens or body.max_tokens or max_model_len - len(prompt_ids)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    jobs = [
        Job(index=c, prompt=prompt_ids, params=sampling_params(body, max_tokens, logprobs, c))
        for c in range(body.n)
    ]
    request_id = new_id("chatcmpl")
    tokenizer = state.engine.tokenizer

    def complete(outputs: list[RequestOutput], created: int) -> dict[str, Any]:
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

    stream = _stream_shape(body, jobs, tokenizer) if body.stream else None
    return await respond(state, jobs, request_id, stream, complete)


def _stream_shape(
    body: ChatCompletionRequest, jobs: list[Job], tokenizer: Tokenizer
) -> StreamShape:
    def chunks(index: int, out: RequestOutput) -> list[dict[str, Any]]:
        choices: list[dict[str, Any]] = []
        logprobs = None
        if body.logprobs and out.new_logprobs:
            logprobs = chat_logprobs(tokenizer, out.new_logprobs)
        if out.delta_text or logprobs is not None:
            choices.append(
                {
                    "index": index,
                    "delta": {"content": out.delta_text},
                    "logprobs": logprobs,
                    "finish_reason": None,
                }
            )
        if out.finished:
            choices.append(
                {
                    "index": index,
                    "delta": {},
                    "logprobs": None,
                    "finish_reason": out.finish_reason,
                    "stop_reason": out.stop_reason,
                }
            )
        return choices

    opening = [
        {
            "index": job.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        for job in jobs
    ]
    return StreamShape(
        obj="chat.completion.chunk",
        opening=opening,
        chunks=chunks,
        prompt_of=lambda index: 0,
        include_usage=body.stream_options is not None and body.stream_options.include_usage,
    )
