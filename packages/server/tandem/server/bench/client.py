"""One streamed completion request, timed the way vLLM's benchmark times it."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from tandem.server.bench.dataset import BenchRequest


@dataclass
class RequestResult:
    success: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    # Gaps between consecutive streamed chunks that carried text.
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def send_completion(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    request: BenchRequest,
    ignore_eos: bool,
    headers: dict[str, str],
) -> RequestResult:
    body = {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(prompt_tokens=len(request.prompt_token_ids))
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    return result
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.output_tokens = int(chunk["usage"]["completion_tokens"])
                    result.prompt_tokens = int(chunk["usage"]["prompt_tokens"])
                if any(c.get("text") for c in chunk.get("choices", [])):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.latency = time.perf_counter() - start
        result.success = result.output_tokens > 0
        if not result.success:
            result.error = "the stream ended without usage or output tokens"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result
