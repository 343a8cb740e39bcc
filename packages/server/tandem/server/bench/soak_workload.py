"""What a soak sends, one request at a time: a mix of streamed and plain, chat and completion
requests (or recommendations), long enough prompts to force preemption in a small KV cache,
some that the client abandons at a random point, some malformed on purpose; and how each one
ended (its outcome)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

OUTCOMES = ("ok", "disconnected", "rejected", "overloaded", "error", "malformed_accepted",
            "transport_error")  # fmt: skip


@dataclass(frozen=True)
class Mix:
    disconnect_rate: float = 0.2
    malformed_rate: float = 0.05
    min_prompt: int = 16
    max_prompt: int = 300
    min_tokens: int = 8
    max_tokens: int = 64


@dataclass
class Result:
    outcome: str
    latency_s: float
    detail: str = ""


# Bodies that must be refused with a 4xx (LLM routes): raw bytes, sent as JSON.
_MALFORMED_LLM = [
    ("/v1/completions", b'{"model": "%s", "prompt": '),
    ("/v1/completions", b'{"model": "%s"}'),
    ("/v1/completions", b'{"model": "%s", "prompt": "x", "temperature": "hot"}'),
    ("/v1/completions", b'{"model": "%s", "prompt": "\\ud800"}'),
    ("/v1/completions", b'{"model": "%s", "prompt": "x", "top_k": 9223372036854775808}'),
    ("/v1/completions", b""),
    ("/v1/chat/completions", b'{"model": "%s", "messages": []}'),
    ("/v1/chat/completions",
     b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "chat_template": "x"}'),
]  # fmt: skip
_MALFORMED_REC = [
    b'{"model": "%s", "history": []}',
    b'{"model": "%s", "history": [[1, 2]]}',
    b'{"model": "%s", "history": [[-1, 0, 0]]}',
    b'{"model": "%s", "history": "none"}',
    b'{"model": "%s", "history": [[0, 0, 0]], "num_candidates": 0}',
]
_WORDS = ["tandem", "serves", "models", "on", "every", "device", "the", "engine", "runs", "fast"]


def _classify(status: int, body: Any, malformed: bool) -> str:
    if malformed:
        if 400 <= status < 500:
            return "rejected"
        return "malformed_accepted" if status < 400 else "error"
    if status == 200:
        return "ok"
    if (
        status == 503
        and isinstance(body, dict)
        and body.get("error", {}).get("code") == "overloaded"
    ):
        return "overloaded"
    return "error"


class LLMWorkload:
    def __init__(self, client: httpx.AsyncClient, model: str, vocab_size: int, mix: Mix):
        self.client = client
        self.model = model
        self.vocab_size = vocab_size
        self.mix = mix

    async def one(self, rng: random.Random) -> Result:
        if rng.random() < self.mix.malformed_rate:
            path, raw = rng.choice(_MALFORMED_LLM)
            body = raw.replace(b"%s", self.model.encode()) if b"%s" in raw else raw
            return await self._send(path, body, stream=False, malformed=True, leave=None)
        chat = rng.random() < 0.5
        stream = rng.random() < 0.5
        length = rng.randint(self.mix.min_prompt, self.mix.max_prompt)
        request: dict[str, Any] = {
            "model": self.model,
            "max_tokens": rng.randint(self.mix.min_tokens, self.mix.max_tokens),
            "stream": stream,
            "temperature": rng.choice([0.0, 0.8]),
            "seed": rng.randrange(1 << 30),
        }
        if chat:
            words = " ".join(rng.choice(_WORDS) for _ in range(length // 2))
            request["messages"] = [{"role": "user", "content": words}]
        else:
            request["prompt"] = [rng.randrange(16, self.vocab_size) for _ in range(length)]
        leave = None
        if rng.random() < self.mix.disconnect_rate:
            # Streams are left after a number of events, plain requests after a delay.
            leave = rng.randint(1, 12) if stream else rng.uniform(0.05, 2.0)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        return await self._send(path, json.dumps(request).encode(), stream, False, leave)

    async def _send(
        self, path: str, body: bytes, stream: bool, malformed: bool, leave: float | None
    ) -> Result:
        started = time.perf_counter()
        headers = {"content-type": "application/json"}
        try:
            if not stream:
                call = self.client.post(path, content=body, headers=headers)
                if leave is not None:
                    try:
                        await asyncio.wait_for(call, leave)
                    except asyncio.TimeoutError:
                        return Result("disconnected", time.perf_counter() - started)
                    return Result("ok", time.perf_counter() - started, "finished before leaving")
                response = await call
                data = response.json() if response.content else None
                outcome = _classify(response.status_code, data, malformed)
                return Result(outcome, time.perf_counter() - started, response.text[:200])
            async with self.client.stream("POST", path, content=body, headers=headers) as response:
                if response.status_code != 200:
                    data = json.loads(await response.aread())
                    outcome = _classify(response.status_code, data, malformed)
                    return Result(outcome, time.perf_counter() - started, str(data)[:200])
                events = 0
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        return Result("ok", time.perf_counter() - started)
                    if '"error"' in line and json.loads(line[6:]).get("error"):
                        return Result("error", time.perf_counter() - started, line[:200])
                    events += 1
                    if leave is not None and events >= leave:
                        return Result("disconnected", time.perf_counter() - started)
                return Result("error", time.perf_counter() - started, "stream ended without [DONE]")
        except httpx.HTTPError as exc:
            return Result("transport_error", time.perf_counter() - started, repr(exc)[:200])


class RecWorkload:
    def __init__(self, client: httpx.AsyncClient, model: str, card: dict[str, Any], mix: Mix):
        self.client = client
        self.model = model
        self.codebooks = int(card["num_codebooks"])
        self.codebook_size = int(card["codebook_size"])
        self.max_history = int(card["max_history"])
        self.mix = mix

    async def one(self, rng: random.Random) -> Result:
        malformed = rng.random() < self.mix.malformed_rate
        if malformed:
            body = rng.choice(_MALFORMED_REC).replace(b"%s", self.model.encode())
        else:
            length = rng.randint(1, self.max_history)
            history = [
                [rng.randrange(self.codebook_size) for _ in range(self.codebooks)]
                for _ in range(length)
            ]
            request = {"model": self.model, "history": history,
                       "num_candidates": rng.randint(1, 10)}  # fmt: skip
            body = json.dumps(request).encode()
        leave = (
            None
            if malformed or rng.random() >= self.mix.disconnect_rate
            else rng.uniform(0.01, 0.5)
        )
        started = time.perf_counter()
        call = self.client.post(
            "/v1/recommendations", content=body, headers={"content-type": "application/json"}
        )
        try:
            if leave is not None:
                try:
                    await asyncio.wait_for(call, leave)
                except asyncio.TimeoutError:
                    return Result("disconnected", time.perf_counter() - started)
                return Result("ok", time.perf_counter() - started, "finished before leaving")
            response = await call
        except httpx.HTTPError as exc:
            return Result("transport_error", time.perf_counter() - started, repr(exc)[:200])
        data = response.json() if response.content else None
        outcome = _classify(response.status_code, data, malformed)
        return Result(outcome, time.perf_counter() - started, response.text[:200])
