"""A request body already read, handed to the next ASGI app as if it arrived now: the body
limits read it whole before the app, and the preparation processes hand on what they made."""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import Message, Receive

# Where the body limits leave a large body they spilled out of the heap (body_buffer.py)
# for the preparation middleware; the app's own reads get it as bytes.
SPILLED_SCOPE_KEY = "tandem.spilled_body"


def replayed_body(body: bytes | Callable[[], bytes], receive: Receive) -> Receive:
    """``receive`` with ``body`` as the request's whole body (or what ``body()`` returns,
    made only if the app reads it); what comes after it (a disconnect) is read from the
    connection as usual."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            data = body if isinstance(body, bytes) else body()
            return {"type": "http.request", "body": data, "more_body": False}
        return await receive()

    return replay
