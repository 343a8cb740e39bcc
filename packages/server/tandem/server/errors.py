"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the status
OpenAI uses, for every way a request can go wrong."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.core import InvalidRequestError
from tandem.core.errors import EngineOverloadedError, EngineUnhealthyError
from tandem.core.failure_text import client_text
from tandem.server.deadline import RequestTimedOut
from tandem.server.error_body import error_body

logger = logging.getLogger(__name__)


class SafeJSONResponse(JSONResponse):
    """JSON whose text may hold a lone surrogate (echoed from a request): written as its
    JSON escape instead of failing to encode (a 500 and a dropped connection)."""

    def render(self, content: Any) -> bytes:
        text = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return text.encode("utf-8", "backslashreplace")


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return SafeJSONResponse(
        error_body(status, message, param, code), status_code=status, headers=headers
    )


def unavailable_response(error: EngineUnhealthyError) -> JSONResponse:
    """503 for an engine that cannot serve (dead, stuck, shutting down), saying why."""
    return error_response(503, f"The engine is not running: {client_text(str(error))}")


def overloaded_response(error: EngineOverloadedError) -> JSONResponse:
    return error_response(
        503,
        client_text(str(error)),
        code="overloaded",
        headers={"Retry-After": str(error.retry_after_s)},
    )


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = _most_telling(errors)
    if first.get("type") == "json_invalid":
        return "We could not parse the JSON body of your request: it is not valid JSON.", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Only the top-level field: deeper entries mix in pydantic's union-branch names.
    param = loc[0] if loc else None
    if first.get("type") == "missing" and param is None:
        return "The request body is empty: send a JSON object.", None
    if first.get("type") == "missing":
        return f"Missing required parameter: '{param}'.", param
    if first.get("type") == "model_attributes_type":
        return "The request body must be a JSON object.", None
    reason = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    reason = reason.replace(" after validation", "")
    return f"Invalid value for '{param}': {reason}.", param


def _most_telling(errors: Sequence[Any]) -> Any:
    """The error to report: of the first field's, one that is not a type mismatch if there
    is one. A field that takes a string or a list (``stop``) fails both branches of its
    union, and pydantic lists the string branch's "Input should be a valid string" first,
    even for a list that failed only for being too long."""
    first = errors[0]
    field = _top_field(first)
    for error in errors:
        if _top_field(error) != field:
            break
        if not str(error.get("type", "")).endswith("_type"):
            return error
    return first


def _top_field(error: Any) -> str | None:
    loc = [str(p) for p in error.get("loc", ()) if p != "body"]
    return loc[0] if loc else None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(400, str(exc), exc.param)

    @app.exception_handler(RequestTimedOut)
    async def _timed_out(_: Request, exc: RequestTimedOut) -> JSONResponse:
        # Past the deadline before any response started (waiting to be prepared).
        return error_response(504, str(exc), code="timeout")

    @app.exception_handler(EngineUnhealthyError)
    async def _dead(_: Request, exc: EngineUnhealthyError) -> JSONResponse:
        return unavailable_response(exc)

    @app.exception_handler(EngineOverloadedError)
    async def _overloaded(_: Request, exc: EngineOverloadedError) -> JSONResponse:
        return overloaded_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.status_code)
        return error_response(exc.status_code, message)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(500, f"Internal server error: {type(exc).__name__}")
