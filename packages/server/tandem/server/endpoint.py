"""The skeleton the completion and chat endpoints share: queue the request's jobs, then
either stream chunks (failure event, usage, ``[DONE]``) or wait for every job and answer once
(or with the error that stopped it). Each endpoint supplies only the shapes of its chunks
and of its final body."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from typing import Any

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from tandem.core import RequestOutput
from tandem.server.common import chunk_base, failure, now, stream_failure, usage
from tandem.server.deadline import RequestTimedOut, request_deadline
from tandem.server.error_body import error_body
from tandem.server.errors import SafeJSONResponse, error_response
from tandem.server.generation import (
    Job,
    final_outputs,
    merge_outputs,
    submit_jobs,
)
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
    request: Request | None = None,
) -> Any:
    """Queue ``jobs`` now (a bad one fails the request before any response starts), then
    stream with ``stream`` or answer ``complete(outputs, created)``. A non-streamed request
    whose client goes away (``request`` disconnects) is aborted; so is any request past the
    server's request timeout."""
    streams = await submit_jobs(state, jobs, request_id)
    created = now()
    # Counted from the request's arrival (DeadlineMiddleware), preparation included.
    deadline = request_deadline()
    limit = state.limits.request_timeout_s
    if deadline is None and limit is not None:
        deadline = asyncio.get_running_loop().time() + limit
    if stream is not None:
        base = chunk_base(state, request_id, stream.obj, created)
        events = _events(state, jobs, streams, stream, base, deadline)
        return StreamingResponse(events, media_type="text/event-stream")
    work = asyncio.ensure_future(final_outputs(state, jobs, streams, deadline))
    try:
        outputs = await _unless_disconnected(work, request)
    except RequestTimedOut as exc:
        return error_response(504, str(exc), code="timeout")
    if outputs is None:
        # Nobody reads this; the jobs were aborted when the client went away.
        return Response(status_code=499)
    failed = failure(outputs)
    if failed is not None:
        return SafeJSONResponse(failed[1], status_code=failed[0])
    return complete(outputs, created)


async def _unless_disconnected(
    work: asyncio.Future[list[RequestOutput]], request: Request | None
) -> list[RequestOutput] | None:
    """``work``'s result, or None (``work`` cancelled, which aborts its jobs) once the
    client of ``request`` disconnects first."""
    if request is None:
        return await work
    gone = asyncio.ensure_future(_disconnected(request))
    waiters: set[asyncio.Future[Any]] = {work, gone}
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if work.done():
        return work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await work
    return None


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body is read by then: what the connection
    delivers next is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _events(
    state: ServerState,
    jobs: list[Job],
    streams: list[Any],
    shape: StreamShape,
    base: dict[str, Any],
    deadline: float | None,
) -> AsyncGenerator[str, None]:
    for choice in shape.opening:
        yield event({**base, "choices": [choice]})
    prompt_tokens: dict[int, int] = {}
    completion_tokens = 0
    ended = True
    try:
        async with contextlib.aclosing(merge_outputs(state, jobs, streams, deadline)) as outputs:
            async for index, out in outputs:
                failed = stream_failure(out)
                if failed is not None:
                    yield event(failed)
                    ended = False
                    break
                for choice in shape.chunks(index, out):
                    yield event({**base, "choices": [choice]})
                if out.finished:
                    prompt_tokens[shape.prompt_of(index)] = len(out.prompt_token_ids)
                    completion_tokens += len(out.token_ids)
    except RequestTimedOut as exc:
        yield event(error_body(504, str(exc), code="timeout"))
        ended = False
    if ended and shape.include_usage:
        totals = usage(sum(prompt_tokens.values()), completion_tokens)
        yield event({**base, "choices": [], "usage": totals})
    yield DONE
