"""The prefix-cache figures of ``tandem bench serve``: counters read from real Prometheus
text, and a whole run against a server whose /metrics counts what a prefix cache would."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, generate_latest

from tandem.server.bench.runner import BenchConfig, run_benchmark
from tandem.server.bench.server_metrics import (
    CacheCounters,
    cache_figures,
    parse_cache_counters,
)


def _counter(registry: CollectorRegistry, name: str, counts: dict[str, float]) -> None:
    # prometheus_client names the sample name + "_total", as a server using it would.
    counter = Counter(name, "doc", ["model_name"], registry=registry)
    for model, count in counts.items():
        counter.labels(model).inc(count)


def test_tandem_counters_are_read_and_summed_over_label_sets() -> None:
    registry = CollectorRegistry()
    _counter(registry, "tandem:prefix_cache_queries", {"a": 100, "b": 28})
    _counter(registry, "tandem:prefix_cache_hits", {"a": 64, "b": 16})
    _counter(registry, "vllm:prefix_cache_queries", {"a": 1})
    _counter(registry, "vllm:prefix_cache_hits", {"a": 1})
    _counter(registry, "tandem:state_snapshot_queries", {"a": 5})
    _counter(registry, "tandem:state_snapshot_hits", {"a": 2})
    counters = parse_cache_counters(generate_latest(registry).decode())
    assert counters == CacheCounters(
        prefix_queries=128, prefix_hits=80, snapshot_queries=5, snapshot_hits=2
    )


def test_vllm_counters_stand_in_and_absent_ones_are_none() -> None:
    registry = CollectorRegistry()
    _counter(registry, "vllm:prefix_cache_queries", {"m": 40, "n": 2})
    _counter(registry, "vllm:prefix_cache_hits", {"m": 30})
    _counter(registry, "tandem:prompt_tokens", {"m": 7})
    counters = parse_cache_counters(generate_latest(registry).decode())
    assert counters == CacheCounters(prefix_queries=42, prefix_hits=30)
    for text in ("", "<html><body>404: Not Found</body></html>", 'x{a="b} 1', "x_total{a="):
        assert parse_cache_counters(text) == CacheCounters()


def test_run_deltas_with_resets_and_empty_runs_unknown() -> None:
    before = CacheCounters(prefix_queries=100, prefix_hits=10, snapshot_queries=3)
    after = CacheCounters(prefix_queries=300, prefix_hits=60, snapshot_queries=9)
    assert cache_figures(before, after) == {
        "prefix_cache_queries": 200,
        "prefix_cache_hits": 50,
        "prefix_cache_hit_rate": 0.25,
        "state_snapshot_queries": None,
        "state_snapshot_hits": None,
    }
    restarted = CacheCounters(prefix_queries=50, prefix_hits=5)
    assert cache_figures(before, restarted)["prefix_cache_queries"] is None
    idle = cache_figures(before, before)
    assert idle["prefix_cache_queries"] == 0 and idle["prefix_cache_hit_rate"] is None
    nan = CacheCounters(prefix_queries=float("nan"), prefix_hits=1)
    assert cache_figures(nan, nan)["prefix_cache_hit_rate"] is None
    assert set(cache_figures(CacheCounters(), after).values()) == {None}


BLOCK = 16


def _common_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _fake_server(serve_metrics: bool) -> web.Application:
    """An OpenAI-ish server whose /metrics counts what a block prefix cache would: each
    prompt's tokens are queried, and its longest full-block prefix seen before is a hit."""
    registry = CollectorRegistry()
    queries = Counter("tandem:prefix_cache_queries", "doc", ["model_name"], registry=registry)
    hits = Counter("tandem:prefix_cache_hits", "doc", ["model_name"], registry=registry)
    seen: list[list[int]] = []

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "vocab_size": 1000}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        prompt: list[int] = (await request.json())["prompt"]
        common = max((_common_len(prompt, earlier) for earlier in seen), default=0)
        seen.append(prompt)
        queries.labels("m").inc(len(prompt))
        hits.labels("m").inc(common // BLOCK * BLOCK)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        usage = {"completion_tokens": 1, "prompt_tokens": len(prompt)}
        await response.write(b'data: {"choices": [{"text": "a"}]}\n\n')
        await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    if serve_metrics:
        app.router.add_get("/metrics", metrics)
    return app


async def _bench(serve_metrics: bool, shared_prefix_len: int) -> dict[str, Any]:
    runner = web.AppRunner(_fake_server(serve_metrics))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    config = BenchConfig(
        base_url=f"http://127.0.0.1:{port}",
        model=None,
        num_prompts=4,
        input_len=8,
        output_len=1,
        range_ratio=0.0,
        # One at a time, so the hits are the same each run.
        max_concurrency=1,
        request_rate=float("inf"),
        ignore_eos=True,
        num_warmups=2,
        seed=3,
        api_key=None,
        vocab_size=None,
        shared_prefix_len=shared_prefix_len,
    )
    try:
        return await run_benchmark(config)
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("serve_metrics", [True, False])
def test_a_run_reports_its_own_prefix_hits(serve_metrics: bool) -> None:
    figures = asyncio.run(_bench(serve_metrics, shared_prefix_len=2 * BLOCK))
    assert figures["completed"] == 4 and figures["shared_prefix_len"] == 2 * BLOCK
    if not serve_metrics:
        assert figures["prefix_cache_queries"] is None
        assert figures["prefix_cache_hit_rate"] is None
        return
    # Only the measured requests count: the first misses (the warm-ups, which hit each
    # other, had another prefix), the three after it hit the prefix's two blocks.
    assert figures["prefix_cache_queries"] == 4 * (2 * BLOCK + 8)
    assert figures["prefix_cache_hits"] == 3 * 2 * BLOCK
    assert figures["prefix_cache_hit_rate"] == pytest.approx(96 / 160)
    assert figures["state_snapshot_queries"] is None
    plain = asyncio.run(_bench(serve_metrics, shared_prefix_len=0))
    assert plain["prefix_cache_queries"] == 4 * 8 and plain["prefix_cache_hits"] == 0
