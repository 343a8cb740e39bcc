"""The FastAPI application: routes, API-key check, body-size limit, error shapes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem.core import EngineDeadError
from tandem.server.chat import create_chat_completion
from tandem.server.completions import create_completion
from tandem.server.errors import error_response, install_error_handlers
from tandem.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tandem.server.state import ServerState
from tandem.server.tokenize import detokenize, tokenize


class _BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """Refuse request bodies over ``limit`` bytes with 413, declared or streamed."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._reject(scope, receive, send)
            return
        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await self._reject(scope, receive, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"The request body is larger than the limit of {self.limit} bytes."
        await error_response(413, message)(scope, receive, send)


class ApiKeyMiddleware:
    """With an API key set, every /v1/* request needs ``Authorization: Bearer KEY``."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and str(scope.get("path", "")).startswith("/v1"):
            auth = dict(scope.get("headers", [])).get(b"authorization")
            if auth != self.expected:
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
        yield
        # Shutdown: aborts what is still running, so every open stream ends.
        state.loop.stop()

    app = FastAPI(title="Tandem", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)

    add_health_and_metrics(app, state.loop.check_health, state.metrics.render)

    @app.get("/v1/models")
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

    # Unversioned, as vLLM serves them.
    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> dict[str, Any]:
        return tokenize(state, body)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> dict[str, Any]:
        return detokenize(state, body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Any:
        return await create_completion(state, body)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest) -> Any:
        return await create_chat_completion(state, body)

    add_limits(app, state.max_body_bytes, state.api_key)
    return app


def add_health_and_metrics(
    app: FastAPI, check_health: Callable[[], None], render_metrics: Callable[[], bytes]
) -> None:
    """``/health`` (503 with the reason once ``check_health`` raises EngineDeadError) and
    ``/metrics`` (Prometheus text), the same for every kind of model."""

    @app.get("/health")
    async def health() -> Response:
        try:
            check_health()
        except EngineDeadError as exc:
            return error_response(503, f"The engine is not running: {exc}")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render_metrics(), media_type="text/plain; version=0.0.4")


def add_limits(app: FastAPI, max_body_bytes: int, api_key: str | None) -> None:
    """The body-size limit and, with a key, the API-key check."""
    # Outermost first: the key check sees the request before the body is read.
    app.add_middleware(BodyLimitMiddleware, limit=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
