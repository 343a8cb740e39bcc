"""Checks and pieces shared by the completion and chat endpoints."""

from __future__ import annotations

import time
import uuid
from typing import Any

from tandem.core import RequestOutput
from tandem.core.failure_text import client_text
from tandem.server.budgets import check_budget
from tandem.server.error_body import error_body
from tandem.server.errors import ApiError
from tandem.server.protocol import _SamplingFields
from tandem.server.state import ServerState


def check_model(served: str, requested: str, aliases: tuple[str, ...] = ()) -> None:
    if requested != served and requested not in aliases:
        raise ApiError(
            404, f"The model `{requested}` does not exist.", param="model", code="model_not_found"
        )


def check_request(state: ServerState, body: _SamplingFields) -> None:
    check_model(state.served_model_name, body.model, state.model_aliases)
    check_budget(state.limits, body)
    if body.n > 1 and body.temperature == 0:
        raise ApiError(
            400,
            f"n={body.n} with temperature 0 asks for {body.n} copies of one greedy answer; "
            "sample (temperature > 0) for different choices, or ask for n=1.",
            param="n",
        )
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options is only allowed with stream=true.", "stream_options")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chunk_base(state: ServerState, request_id: str, obj: str, created: int) -> dict[str, Any]:
    return {"id": request_id, "object": obj, "created": created, "model": state.served_model_name}


def stream_failure(out: RequestOutput) -> dict[str, Any] | None:
    """The error event a stream ends with when its request failed or was aborted."""
    failed = failure([out])
    return None if failed is None else failed[1]


def failure(outputs: list[RequestOutput]) -> tuple[int, dict[str, Any]] | None:
    """The error to answer with when a job could not finish normally, if any: 400 naming the
    field when the client's input could not be served (a grammar past the grammar engine's
    limits mid-output: the client's fault, whatever tokens came before), 500 naming the
    cause when the engine failed, 503 when the server aborted it (shutting down)."""
    for out in outputs:
        if out.finish_reason == "error" and out.error_param is not None:
            message = client_text(out.error or "the request cannot be served")
            return 400, error_body(
                400, f"The request cannot be served: {message}.", param=out.error_param
            )
        if out.finish_reason == "error":
            message = client_text(out.error or "the engine failed")
            return 500, error_body(500, f"Generation failed: {message}")
        if out.finish_reason == "abort":
            reason = client_text(out.error or "the server is shutting down")
            return 503, error_body(503, f"The request was aborted: {reason}.")
    return None
