"""The OpenAPI description of every route: request bodies come from ``protocol.py``, the
bodies answered (success and OpenAI-shaped errors, with their statuses) from here. The
routes answer plain dicts; these models only describe them, and API fuzzing checks every
answer against them."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Body):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Body):
    error: ErrorDetail


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(_Body):
    tokens: list[str]
    # None for an echoed prompt's first token (nothing before it to score it).
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ScoredToken(_Body):
    logprob: float
    rank: int | None
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token (None for the first), by token id.
PromptLogprobs = list[dict[str, ScoredToken] | None]


class CompletionChoice(_Body):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(_Body):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(_Body):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Body):
    content: list[TokenLogprob]


class CalledFunction(_Body):
    name: str | None
    arguments: str


class ToolCall(_Body):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(_Body):
    role: Literal["assistant"]
    content: str | None
    # With a reasoning parser (--reasoning-parser), both names, as vLLM and DeepSeek use.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Body):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None


class ChatCompletionResponse(_Body):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None


class TokenizeResponse(_Body):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(_Body):
    prompt: str


class ModelCard(BaseModel):
    # Each kind of model adds fields of its own (context length, codebooks).
    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str


class ModelList(_Body):
    object: Literal["list"]
    data: list[ModelCard]


class Candidate(_Body):
    item: list[int]
    score: float


class RecommendationUsage(_Body):
    history_items: int
    candidates: int


class RecommendationResponse(_Body):
    id: str
    object: Literal["recommendation"]
    created: int
    model: str
    candidates: list[Candidate]
    usage: RecommendationUsage


_ERRORS = {
    400: "The request is malformed or can never be served.",
    401: "The API key is missing or wrong (only with --api-key).",
    404: "Unknown model.",
    408: "The request body did not arrive in time.",
    413: "The request body is over the size limit.",
    500: "Generation failed (the engine failed while running the request).",
    503: "The engine is not running, or is overloaded (then with Retry-After).",
    504: "The request ran past the server's --request-timeout-s.",
}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    responses: dict[int | str, dict[str, Any]] = {
        status: {"model": ErrorResponse, "description": _ERRORS[status]} for status in statuses
    }
    if 503 in responses:
        responses[503]["headers"] = {
            "Retry-After": {
                "description": "Seconds to wait before retrying, when overloaded.",
                "schema": {"type": "string"},
            }
        }
    return responses


def post_responses(success: type[BaseModel], streams: bool) -> dict[int | str, dict[str, Any]]:
    """What a POST route answers: ``success`` (and server-sent events with ``streams``), or
    an error."""
    ok: dict[str, Any] = {"model": success, "description": "The result."}
    if streams:
        ok["description"] = "The result, or with stream=true server-sent events."
        ok["content"] = {"text/event-stream": {"schema": SSE_EVENT}}
    return {200: ok, **_errors(400, 401, 404, 408, 413, 500, 503, 504)}


# One server-sent event of a stream, as SSE readers (and schemathesis) parse it: its data is
# a chunk of JSON, or [DONE] at the end; OpenAI streams set no event name, id or retry.
SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "data": {"type": "string", "description": "A JSON chunk, or [DONE] after the last."},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
    "required": ["data"],
}

MODELS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": ModelList, "description": "The served model."},
    **_errors(401),
}
HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The engine serves (no body)."},
    **_errors(503),
}
METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Prometheus text.",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }
}


def drop_unused_validation_responses(app: FastAPI) -> None:
    """FastAPI documents a 422 for every body; bad bodies get 400 here (errors.py)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        components = schema.get("components", {}).get("schemas", {})
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
