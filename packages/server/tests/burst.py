"""A burst of identical requests at once, for the admission tests of both products."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx


async def check_burst(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], admitted: int, why: str
) -> list[httpx.Response]:
    """Posts ``body`` to ``path`` 30 times at once: exactly ``admitted`` are answered and the
    rest refused with 503, Retry-After and a message naming ``why``; then, every place given
    back, a second burst of ``admitted`` is answered in full. Returns the first burst's
    answers."""
    answers = list(await asyncio.gather(*(client.post(path, json=body) for _ in range(30))))
    statuses = [r.status_code for r in answers]
    assert statuses.count(200) == admitted, statuses
    assert statuses.count(503) == 30 - admitted, statuses
    for response in answers:
        if response.status_code == 503:
            assert response.headers["retry-after"] == "1"
            error = response.json()["error"]
            assert error["code"] == "overloaded", error
            assert why in error["message"], error
    again = await asyncio.gather(*(client.post(path, json=body) for _ in range(admitted)))
    assert [r.status_code for r in again] == [200] * admitted
    return answers
