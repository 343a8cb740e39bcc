"""POST /v1/completions."""

from __future__ import annotations

from typing import Any

from tandem.core import RequestOutput
from tandem.core.llm.engine import Prompt
from tandem.core.llm.sequence import TokenLogprobs
from tandem.core.llm.tokenizer import Tokenizer
from tandem.server.common import check_request, new_id, usage
from tandem.server.endpoint import StreamShape, respond
from tandem.server.errors import ApiError
from tandem.server.generation import Job, sampling_params
from tandem.server.protocol import CompletionRequest
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

    def complete(outputs: list[RequestOutput], created: int) -> dict[str, Any]:
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

    stream = _stream_shape(body, jobs, echoes, tokenizer) if body.stream else None
    return await respond(state, jobs, request_id, stream, complete)


def _stream_shape(
    body: CompletionRequest, jobs: list[Job], echoes: list[str], tokenizer: Tokenizer
) -> StreamShape:
    offsets = [len(e) for e in echoes]

    def chunks(index: int, out: RequestOutput) -> list[dict[str, Any]]:
        logprobs = None
        if body.logprobs is not None and out.new_logprobs:
            logprobs = legacy_logprobs(tokenizer, out.new_logprobs, offsets[index])
        offsets[index] += len(out.delta_text)
        if not (out.delta_text or logprobs is not None or out.finished):
            return []
        choice: dict[str, Any] = {
            "index": index,
            "text": out.delta_text,
            "logprobs": logprobs,
            "finish_reason": out.finish_reason if out.finished else None,
        }
        if out.finished:
            choice["stop_reason"] = out.stop_reason
        return [choice]

    opening = [
        {"index": job.index, "text": echo, "logprobs": None, "finish_reason": None}
        for job, echo in zip(jobs, echoes, strict=True)
        if echo
    ]
    return StreamShape(
        obj="text_completion",
        opening=opening,
        chunks=chunks,
        prompt_of=lambda index: index // body.n,
        include_usage=body.stream_options is not None and body.stream_options.include_usage,
    )
