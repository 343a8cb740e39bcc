"""The FastAPI application: routes, API-key check, body-size and body-time limits, error
shapes."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from tandem.core.errors import EngineUnhealthyError
from tandem.server.body_buffer import SPILL_BYTES, Spilled
from tandem.server.chat import create_chat_completion
from tandem.server.completions import create_completion
from tandem.server.deadline import DeadlineMiddleware
from tandem.server.errors import (
    SafeJSONResponse,
    error_response,
    install_error_handlers,
    unavailable_response,
)
from tandem.server.openapi import (
    HEALTH_RESPONSES,
    METRICS_RESPONSES,
    MODELS_RESPONSES,
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    TokenizeResponse,
    drop_unused_validation_responses,
    post_responses,
)
from tandem.server.preparer import PreparationMiddleware, worker_spec
from tandem.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tandem.server.replayed_body import SPILLED_SCOPE_KEY, replayed_body
from tandem.server.state import ServerLimits, ServerState
from tandem.server.tokenize import check_tokenize_budget, detokenize, tokenize


class BodyLimitMiddleware:
    """Read each request body whole before the app sees it: over ``limit`` bytes, declared
    or streamed (chunked), it is refused with 413, after the rest of it was read and dropped
    (within bounds) so that the client reads the answer; one that does not arrive within
    ``timeout_s`` (a body shorter than its Content-Length, a stalled client) gets 408 instead
    of holding the connection for ever. The app then reads the buffered body, and what comes
    after it (a disconnect) from the connection as usual."""

    def __init__(self, app: ASGIApp, limit: int, timeout_s: float = 30.0) -> None:
        self.app = app
        self.limit = limit
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        declared = headers.get(b"content-length")
        loop = asyncio.get_running_loop()
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            # A client waiting for "100 Continue" has sent nothing yet: reading would ask it to.
            if headers.get(b"expect", b"").lower() != b"100-continue":
                await _discard_rest(receive, loop.time() + _DISCARD_S)
            await self._too_large(scope, receive, send)
            return
        deadline = loop.time() + self.timeout_s
        chunks: list[bytes] = []
        size = 0
        # A large body goes into a mapping of its own (body_buffer.py), not the heap.
        spilled: Spilled | None = None
        try:
            while True:
                try:
                    message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
                except asyncio.TimeoutError:
                    text = f"The request body did not arrive within {self.timeout_s:g} s."
                    await _closing(error_response(408, text))(scope, receive, send)
                    return
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.limit:
                    if message.get("more_body", False):
                        await _discard_rest(receive, min(deadline, loop.time() + _DISCARD_S))
                    await self._too_large(scope, receive, send)
                    return
                if spilled is None and size > SPILL_BYTES:
                    # h11 delivers no more than a Content-Length declares.
                    known = declared is not None and declared.isdigit()
                    spilled = Spilled(int(declared or 0) if known else self.limit)
                    for earlier in chunks:
                        spilled.write(earlier)
                    chunks.clear()
                if spilled is not None:
                    spilled.write(chunk)
                else:
                    chunks.append(chunk)
                if not message.get("more_body", False):
                    break
            if spilled is None:
                await self.app(scope, replayed_body(b"".join(chunks), receive), send)
                return
            # The preparation middleware takes a spilled body from the scope; any other app
            # reads it as bytes.
            inner = {**scope, SPILLED_SCOPE_KEY: spilled}
            await self.app(inner, replayed_body(spilled.to_bytes, receive), send)
        finally:
            if spilled is not None:
                spilled.close()

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"The request body is larger than the limit of {self.limit} bytes."
        await _closing(error_response(413, message))(scope, receive, send)


# How long, and how many bytes, of an oversized body are read on and thrown away before
# the 413: a client that is still sending when the server closes gets a connection reset
# (the unread bytes make Linux answer with RST) instead of the answer.
_DISCARD_S = 5.0
_DISCARD_BYTES = 256 << 20


async def _discard_rest(receive: Receive, until: float) -> None:
    """Read the rest of a request body and drop it, until it ends, the client leaves,
    ``until`` (loop time) passes or ``_DISCARD_BYTES`` were read."""
    loop = asyncio.get_running_loop()
    dropped = 0
    while dropped < _DISCARD_BYTES:
        try:
            message = await asyncio.wait_for(receive(), max(until - loop.time(), 0))
        except asyncio.TimeoutError:
            return
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            return
        dropped += len(message.get("body", b""))


def _closing(response: Response) -> Response:
    """The connection closes after ``response``: nothing more of the request is read."""
    response.headers["connection"] = "close"
    return response


# What answers without the key: the liveness probe, and the Prometheus scrape (aggregate
# counters only, read by scrapers that commonly carry no key, as with vLLM).
OPEN_PATHS = frozenset({"/health", "/metrics"})


class ApiKeyMiddleware:
    """With an API key set, every request but ``OPEN_PATHS`` needs ``Authorization: Bearer
    KEY``: /v1/*, /tokenize, /detokenize, the OpenAPI document, unknown paths. It is the
    outermost layer: a request without the key gets its 401 before its body is read."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and str(scope.get("path", "")) not in OPEN_PATHS:
            auth = dict(scope.get("headers", [])).get(b"authorization", b"")
            # Constant time: how long the comparison takes says nothing about the key.
            if not hmac.compare_digest(auth, self.expected):
                response = error_response(
                    401,
                    "Incorrect or missing API key: send Authorization: Bearer <key>.",
                    code="invalid_api_key",
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.preparer.start_processes(worker_spec(state), state.limits.prepare_processes)
        yield
        # Shutdown: aborts what is still running, so every open stream ends.
        state.loop.stop()
        state.preparer.shutdown()

    app = new_app(lifespan)
    add_health_and_metrics(app, state.loop.check_health, state.metrics.render)

    @app.get("/v1/models", responses=MODELS_RESPONSES)
    async def models() -> dict[str, Any]:
        engine = state.engine
        cards = [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "tandem",
                "root": engine.config.model.model,
                "max_model_len": engine.max_model_len,
                "vocab_size": engine.model_config.vocab_size,
            }
            for name in (state.served_model_name, *state.model_aliases)
        ]
        return {"object": "list", "data": cards}

    # Unversioned, as vLLM serves them; off the event loop (templates, long inputs).
    @app.post("/tokenize", responses=post_responses(TokenizeResponse, streams=False))
    async def tokenize_route(body: TokenizeRequest) -> dict[str, Any]:
        check_tokenize_budget(state, body)
        return await state.preparer.run(lambda: tokenize(state, body))

    @app.post("/detokenize", responses=post_responses(DetokenizeResponse, streams=False))
    async def detokenize_route(body: DetokenizeRequest) -> dict[str, Any]:
        check_tokenize_budget(state, body)
        return await state.preparer.run(lambda: detokenize(state, body))

    @app.post(
        "/v1/completions",
        response_model=None,
        responses=post_responses(CompletionResponse, streams=True),
    )
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await create_completion(state, body, request)

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses=post_responses(ChatCompletionResponse, streams=True),
    )
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        return await create_chat_completion(state, body, request)

    # Innermost: large bodies are prepared in a process once the limits let them in.
    app.add_middleware(PreparationMiddleware, preparer=state.preparer)
    add_limits(app, state.max_body_bytes, state.api_key, state.limits)
    return app


def new_app(lifespan: Callable[[FastAPI], Any]) -> FastAPI:
    """The application every kind of model starts from: error shapes, JSON that survives
    what clients echo, an OpenAPI description without FastAPI's unused 422s."""
    app = FastAPI(
        title="Tandem",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        default_response_class=SafeJSONResponse,
    )
    install_error_handlers(app)
    drop_unused_validation_responses(app)
    return app


def add_health_and_metrics(
    app: FastAPI, check_health: Callable[[], None], render_metrics: Callable[[], bytes]
) -> None:
    """``/health`` (503 with the reason while ``check_health`` raises: the engine died, a
    step is past the health deadline, a worker is stopped) and ``/metrics`` (Prometheus
    text), the same for every kind of model."""

    @app.get("/health", response_model=None, response_class=Response, responses=HEALTH_RESPONSES)
    async def health() -> Response:
        try:
            check_health()
        except EngineUnhealthyError as exc:
            return unavailable_response(exc)
        return Response(status_code=200)

    @app.get(
        "/metrics",
        response_model=None,
        response_class=PlainTextResponse,
        responses=METRICS_RESPONSES,
    )
    async def metrics() -> Response:
        return Response(render_metrics(), media_type="text/plain; version=0.0.4")


def add_limits(
    app: FastAPI, max_body_bytes: int, api_key: str | None, limits: ServerLimits
) -> None:
    """The body-size and body-time limits, the request deadline and, with a key, the API-key
    check."""
    # Each one added wraps the ones before: the key check runs first, before the deadline is
    # stamped and before the body is read.
    app.add_middleware(BodyLimitMiddleware, limit=max_body_bytes, timeout_s=limits.body_timeout_s)
    app.add_middleware(DeadlineMiddleware, timeout_s=limits.request_timeout_s)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
