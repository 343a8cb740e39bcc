"""One streamed completion request, timed the way vLLM's benchmark times it.

The client shares the machine with the server it measures (on a CPU host, the same cores),
so it is built to cost little per streamed chunk: aiohttp on uvloop spends about a fifth
of the CPU httpx on asyncio does (measured on 2 cores, 96 requests x 128 tokens: 0.8 s
against 3.9 s), CPU a server under test would otherwise lose to its own benchmark.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tandem.server.bench.dataset import BenchRequest


@dataclass
class RequestResult:
    success: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    # Gaps between consecutive streamed chunks that carried text.
    itl: list[float] = field(default_factory=list)
    error: str = ""
    # In a multi-turn run: the turn of its conversation, from 1 (None: not in a conversation).
    turn: int | None = None
    # The generated token ids, where they were asked for and every one of them came back.
    output_token_ids: list[int] | None = None


# What a request adds to get its generated token ids back: the completions API's logprobs
# name each token ``token_id:N`` (vLLM's extension, which Tandem serves too), where a
# token's text would not say which id it was. 0: no alternatives, the sampled tokens only.
TOKEN_ID_FIELDS = {"logprobs": 0, "return_tokens_as_token_ids": True}

# How a request fails that never reached a server: sent on a kept-alive connection the
# server had already closed. llama.cpp's llama-server closes the connection after each
# streamed response while its headers say keep-alive, and under load the next request can
# take that connection from the pool before its close arrives (the pool may hold several).
# Such a request is sent again, once, on a connection of its own that nobody can have
# closed yet; its times still count from the first try.
STALE_CONNECTION_ERRORS = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


async def sse_data(pieces: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """The ``data:`` payloads of a server-sent event stream, from the pieces the socket
    gives (cut anywhere; no line-length limit: one event may be long, e.g. with logprobs)."""
    pending = b""
    async for piece in pieces:
        pending += piece
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip()
    if pending.startswith(b"data:"):
        yield pending[5:].strip()


async def send_completion(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    request: BenchRequest,
    ignore_eos: bool,
    headers: dict[str, str],
    token_ids: bool = False,
) -> RequestResult:
    """``token_ids``: also ask for the generated token ids, into ``output_token_ids``."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if token_ids:
        body |= TOKEN_ID_FIELDS
    result = RequestResult(prompt_tokens=len(request.prompt_token_ids))
    # None once a token came back without its id: the ids are then not the output's.
    ids: list[int] | None = []
    start = time.perf_counter()
    last = start
    try:
        async with _posted(session, url, body, headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return result
            async for data in sse_data(response.content.iter_any()):
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    return result
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.output_tokens = int(chunk["usage"]["completion_tokens"])
                    result.prompt_tokens = int(chunk["usage"]["prompt_tokens"])
                choices = chunk.get("choices", [])
                if token_ids and ids is not None:
                    ids = _with_token_ids(ids, choices)
                if any(c.get("text") for c in choices):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.latency = time.perf_counter() - start
        result.success = result.output_tokens > 0
        if not result.success:
            result.error = "the stream ended without usage or output tokens"
        elif token_ids and ids is not None and len(ids) == result.output_tokens:
            result.output_token_ids = ids
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


@contextlib.asynccontextmanager
async def _posted(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> AsyncIterator[aiohttp.ClientResponse]:
    """The response, the request sent again once on a new connection where the pooled one
    it went out on turned out closed before any answer (see STALE_CONNECTION_ERRORS)."""
    try:
        response = await session.post(url, json=body, headers=headers)
    except STALE_CONNECTION_ERRORS:
        async with (
            aiohttp.ClientSession(timeout=session.timeout) as fresh,
            fresh.post(url, json=body, headers=headers) as response,
        ):
            yield response
        return
    async with response:
        yield response


def _with_token_ids(ids: list[int], choices: list[dict[str, Any]]) -> list[int] | None:
    """``ids`` and those a chunk's ``choices`` carry as ``token_id:N`` logprobs tokens;
    None where a token is named otherwise (a server without the extension names it by its
    text, which says nothing certain about its id)."""
    for choice in choices:
        logprobs = choice.get("logprobs")
        if not isinstance(logprobs, dict):
            continue
        for name in logprobs.get("tokens") or []:
            kind, _, number = str(name).partition(":")
            if kind != "token_id" or not number.isdigit():
                return None
            ids.append(int(number))
    return ids
