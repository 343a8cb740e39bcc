"""The body of an OpenAI-shaped error, ``{"error": {"message", "type", "param", "code"}}``,
apart from the FastAPI handlers in ``errors``: the connection guard answers raw HTTP with it,
and every CLI command imports that guard, so this module must not import FastAPI (half a
second of every ``tandem generate`` and every spawned rank process)."""

from __future__ import annotations

from typing import Any

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }
