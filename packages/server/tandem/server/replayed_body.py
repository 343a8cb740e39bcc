"""A request body already read, handed to the next ASGI app as if it arrived now: the body
limits read it whole before the app, and the preparation processes hand on what they made."""

from __future__ import annotations

from starlette.types import Message, Receive


def replayed_body(body: bytes, receive: Receive) -> Receive:
    """``receive`` with ``body`` as the request's whole body; what comes after it (a
    disconnect) is read from the connection as usual."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
