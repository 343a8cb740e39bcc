"""A Qwen3.5 composite checkpoint (``Qwen3_5ForConditionalGeneration``: hybrid text model,
vision tower skipped) served by a real ``tandem serve`` process with fewer state slots than
concurrent requests and two pipeline lanes: a load of streams, a third of them dropped by
their clients mid-stream, all end; afterwards ``/metrics`` shows every state slot and KV
block returned. Image content gets a clear 400; a prompt that continues another starts from
its state snapshot, and /metrics counts it."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from harness import Server, ServerFactory, async_openai_client
from reference_models import write_reference_model

NAME = "qwen3_5-vl"
STREAMS = 24
SLOTS = 4


@pytest.fixture(scope="module")
def server(start_server: ServerFactory, tmp_path_factory: pytest.TempPathFactory) -> Server:
    folder = tmp_path_factory.mktemp("hybrid") / NAME
    write_reference_model(folder, "Qwen3_5ForConditionalGeneration")
    return start_server(
        "--model", str(folder), "--served-model-name", NAME, "--num-state-slots", str(SLOTS),
        "--max-concurrency", "2", demo_model=False,
    )  # fmt: skip


def _finished(server: Server, reason: str) -> float:
    for line in httpx.get(f"{server.base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("tandem:request_success_total") and f'"{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_load_with_dropped_streams_returns_every_state_slot(server: Server) -> None:
    client = async_openai_client(server.base_url)
    usage_seen: list[float] = []

    async def one(i: int) -> str | None:
        drop = i % 3 == 0
        stream = await client.completions.create(
            model=NAME,
            prompt=[5 + (i * 37 + j) % 500 for j in range(8 + i)],
            # Dropped streams ask for far more than they read: the abort, not the length
            # limit, ends them.
            max_tokens=400 if drop else 32,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        reason = None
        chunks = 0
        async for chunk in stream:
            chunks += 1
            reason = chunk.choices[0].finish_reason or reason
            if drop and chunks == 4:
                usage_seen.append(server.metric("tandem:state_slot_usage_perc"))
                await stream.close()  # the client goes away: the server aborts the request
                return "dropped"
        return reason

    async def main() -> list[str | None]:
        try:
            return await asyncio.gather(*(one(i) for i in range(STREAMS)))
        finally:
            await client.close()

    aborted_before = _finished(server, "abort")
    length_before = _finished(server, "length")
    results = asyncio.run(main())
    dropped = results.count("dropped")
    assert dropped == STREAMS // 3
    assert results.count("length") == STREAMS - dropped
    # Slots were in use while streams ran (and never more than the pool).
    assert usage_seen and max(usage_seen) > 0 and all(u <= 1 for u in usage_seen)
    server.wait_idle()
    assert server.metric("tandem:state_slot_usage_perc") == 0
    assert server.metric("tandem:kv_cache_usage_perc") == 0
    assert _finished(server, "abort") == aborted_before + dropped
    assert _finished(server, "length") == length_before + STREAMS - dropped


def test_image_content_is_a_clear_400(server: Server) -> None:
    body = {
        "model": NAME,
        "max_tokens": 4,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
                    {"type": "text", "text": "what is in the picture?"},
                ],
            }
        ],
    }
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages[0].content"
    assert error["code"] == "unsupported_content_type"
    assert "image_url" in error["message"] and "text only" in error["message"]
    # Text parts alone are fine.
    body["messages"][0]["content"] = [{"type": "text", "text": "hello"}]  # type: ignore[index]
    assert httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60).is_success


def test_a_prompt_that_continues_another_starts_from_its_state_snapshot(server: Server) -> None:
    """/metrics counts the lookups, the hit and the prompt tokens taken from the cache (vLLM's
    prefix_cache_* in tokens; the tokens are checked against no caching elsewhere)."""
    names = ("prefix_cache_queries", "prefix_cache_hits", "state_snapshot_queries",
             "state_snapshot_hits")  # fmt: skip
    before = {n: server.metric(f"tandem:{n}_total") for n in names}
    prompt = [7 + (j * 13) % 400 for j in range(120)]
    body = {"model": NAME, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        assert http.post("/v1/completions", json={**body, "prompt": prompt}).status_code == 200
        follow_up = {**body, "prompt": [*prompt, 9, 10, 11]}
        cached = http.post("/v1/completions", json=follow_up)
        assert cached.status_code == 200, cached.text
        after = {n: server.metric(f"tandem:{n}_total") for n in names}
        assert after["state_snapshot_queries"] - before["state_snapshot_queries"] == 2
        assert after["state_snapshot_hits"] - before["state_snapshot_hits"] == 1
        assert after["prefix_cache_queries"] - before["prefix_cache_queries"] == 120 + 123
        assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 120
