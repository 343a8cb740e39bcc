"""The skeleton the completion and chat endpoints share: queue the request's jobs, then
either stream chunks (failure event, usage, ``[DONE]``) or wait for every job and answer once
(or with the error that stopped it). Each endpoint supplies only the shapes of its chunks
and of its final body."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from tandem.core import RequestOutput
from tandem.server.common import chunk_base, failure, now, stream_failure, usage
from tandem.server.generation import Job, final_outputs, merge_outputs, submit_jobs
from tandem.server.sse import DONE, event
from tandem.server.state import ServerState

Choice = dict[str, Any]


class StreamShape:
    """What a streaming endpoint sends besides the shared framing."""

    def __init__(
        self,
        obj: str,
        opening: list[Choice],
        chunks: Callable[[int, RequestOutput], list[Choice]],
        prompt_of: Callable[[int], int],
        include_usage: bool,
    ) -> None:
        """``obj``: the chunks' object name; ``opening``: choices sent before any output;
        ``chunks(index, out)``: the choices one output becomes; ``prompt_of(index)``: which
        prompt a job belongs to (usage counts each prompt once)."""
        self.obj = obj
        self.opening = opening
        self.chunks = chunks
        self.prompt_of = prompt_of
        self.include_usage = include_usage


async def respond(
    state: ServerState,
    jobs: list[Job],
    request_id: str,
    stream: StreamShape | None,
    complete: Callable[[list[RequestOutput], int], dict[str, Any]],
) -> Any:
    """Queue ``jobs`` now (a bad one fails the request before any response starts), then
    stream with ``stream`` or answer ``complete(outputs, created)``."""
    streams = submit_jobs(state, jobs, request_id)
    created = now()
    if stream is not None:
        base = chunk_base(state, request_id, stream.obj, created)
        events = _events(state, jobs, streams, stream, base)
        return StreamingResponse(events, media_type="text/event-stream")
    outputs = await final_outputs(state, jobs, streams)
    failed = failure(outputs)
    if failed is not None:
        return JSONResponse(failed[1], status_code=failed[0])
    return complete(outputs, created)


async def _events(
    state: ServerState,
    jobs: list[Job],
    streams: list[Any],
    shape: StreamShape,
    base: dict[str, Any],
) -> AsyncGenerator[str, None]:
    for choice in shape.opening:
        yield event({**base, "choices": [choice]})
    prompt_tokens: dict[int, int] = {}
    completion_tokens = 0
    async for index, out in merge_outputs(state, jobs, streams):
        failed = stream_failure(out)
        if failed is not None:
            yield event(failed)
            break
        for choice in shape.chunks(index, out):
            yield event({**base, "choices": [choice]})
        if out.finished:
            prompt_tokens[shape.prompt_of(index)] = len(out.prompt_token_ids)
            completion_tokens += len(out.token_ids)
    else:
        if shape.include_usage:
            totals = usage(sum(prompt_tokens.values()), completion_tokens)
            yield event({**base, "choices": [], "usage": totals})
    yield DONE
