"""The multi-turn mode of ``tandem bench serve``: whole runs against a fake server that names
its generated tokens ``token_id:N``, as Tandem's does when asked for
return_tokens_as_token_ids, recording what it received and when."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from tandem.server.bench.client import RequestResult
from tandem.server.bench.dataset import random_requests
from tandem.server.bench.report import format_table, summarize
from tandem.server.bench.runner import BenchConfig, run_benchmark
from tandem.server.cli.main import build_parser

VOCAB = 1000


@dataclass
class Received:
    body: dict[str, Any]
    output: list[int]
    start: float
    end: float = 0.0


@dataclass
class FakeServer:
    """``token_ids``: name generated tokens by id where asked (False: a server without the
    extension, which sends no logprobs); prompts longer than ``max_prompt`` get a 400."""

    token_ids: bool = True
    max_prompt: int = 10_000
    received: list[Received] = field(default_factory=list)
    in_flight: int = 0
    most_in_flight: int = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "vocab_size": VOCAB}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt: list[int] = body["prompt"]
        if len(prompt) > self.max_prompt:
            return web.json_response({"error": {"message": "prompt too long"}}, status=400)
        # Depends on the prompt alone, so a run's prompts are the same each time.
        output = [16 + (sum(prompt) + i) % (VOCAB - 16) for i in range(body["max_tokens"])]
        record = Received(body, output, start=time.perf_counter())
        self.received.append(record)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        named = self.token_ids and body.get("return_tokens_as_token_ids")
        for token in output:
            await asyncio.sleep(0.01)
            logprobs = None
            if named and body.get("logprobs") is not None:
                name = f"token_id:{token}"
                logprobs = {
                    "tokens": [name],
                    "token_logprobs": [-0.5],
                    "top_logprobs": [{name: -0.5}],
                    "text_offset": [0],
                }
            choice = {"index": 0, "text": "a", "logprobs": logprobs, "finish_reason": None}
            await response.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        last = {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
        usage = {"completion_tokens": len(output), "prompt_tokens": len(prompt)}
        await response.write(f"data: {json.dumps({'choices': [last]})}\n\n".encode())
        await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        self.in_flight -= 1
        record.end = time.perf_counter()
        return response


def _config(port: int, **overrides: Any) -> BenchConfig:
    settings: dict[str, Any] = {
        "base_url": f"http://127.0.0.1:{port}",
        "model": None,
        "num_prompts": 4,
        "input_len": 8,
        "output_len": 3,
        "range_ratio": 0.0,
        "max_concurrency": 2,
        "request_rate": float("inf"),
        "ignore_eos": True,
        "num_warmups": 0,
        "seed": 5,
        "api_key": None,
        "vocab_size": None,
    }
    return BenchConfig(**(settings | overrides))


async def _bench(server: FakeServer, **overrides: Any) -> dict[str, Any]:
    runner = web.AppRunner(server.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        return await run_benchmark(_config(runner.addresses[0][1], **overrides))
    finally:
        await runner.cleanup()


def _conversations(received: list[Received]) -> list[list[Received]]:
    """The requests chained by prompt: each after the first opens with the one before it
    and that one's output (and so with all the turns before, hence the shortest)."""
    chains = [[r] for r in received if not any(_follows(r, earlier) for earlier in received)]
    for chain in chains:
        while follow := [r for r in received if _follows(r, chain[-1])]:
            chain.append(min(follow, key=lambda r: len(r.body["prompt"])))
    assert sorted(id(r) for c in chains for r in c) == sorted(id(r) for r in received)
    return chains


def _follows(later: Received, earlier: Received) -> bool:
    before = earlier.body["prompt"] + earlier.output
    return bool(later.body["prompt"][: len(before)] == before) and later is not earlier


def test_each_later_turn_carries_the_conversation_before_it() -> None:
    server = FakeServer()
    figures = asyncio.run(_bench(server, turns=3, range_ratio=0.25))
    assert (figures["completed"], figures["failed"], figures["turns"]) == (12, 0, 3)
    assert all(
        r.body["logprobs"] == 0 and r.body["return_tokens_as_token_ids"] is True
        for r in server.received
    )
    conversations = _conversations(server.received)
    assert len(conversations) == 4 and all(len(c) == 3 for c in conversations)
    # First turns are the prompts a single-turn run sends.
    firsts = random_requests(4, 8, 3, range_ratio=0.25, vocab_size=VOCAB, seed=5)
    assert sorted(c[0].body["prompt"] for c in conversations) == sorted(
        r.prompt_token_ids for r in firsts
    )
    for turns in conversations:
        for earlier, later in itertools.pairwise(turns):
            own = later.body["prompt"][len(earlier.body["prompt"]) + len(earlier.output) :]
            assert 6 <= len(own) <= 10 and all(16 <= t < VOCAB for t in own)
            assert 2 <= later.body["max_tokens"] <= 3
            # One after another: a turn is sent once the turn before it has finished.
            assert later.start >= earlier.end
    # Two conversations at a time, never more: conversations, not requests, are capped.
    assert server.most_in_flight == 2
    assert figures["mean_ttft_first_turn_ms"] > 0 and figures["mean_ttft_later_turns_ms"] > 0
    # The user messages follow --seed, whatever order the conversations ran in.
    again = FakeServer()
    asyncio.run(_bench(again, turns=3, range_ratio=0.25))
    assert sorted(r.body["prompt"] for r in again.received) == sorted(
        r.body["prompt"] for r in server.received
    )


@pytest.mark.parametrize(
    ("server", "error"),
    [
        (FakeServer(token_ids=False), "turn 1 came back without its generated token ids"),
        # The second turn (8 + 3 + 8 tokens) is too long for this server.
        (FakeServer(max_prompt=12), "turn 2 failed; the conversation's remaining turns"),
    ],
)
def test_a_turn_that_cannot_go_on_fails_the_rest_of_its_conversation(
    server: FakeServer, error: str
) -> None:
    figures = asyncio.run(_bench(server, num_prompts=2, turns=3))
    # The other turns count as failed requests; the run goes on to its report.
    assert (figures["num_prompts"], figures["completed"], figures["failed"]) == (6, 2, 4)
    assert len(server.received) == 2
    assert any(e.startswith(error) for e in figures["errors"])
    assert figures["mean_ttft_first_turn_ms"] > 0
    assert figures["mean_ttft_later_turns_ms"] is None
    later = [line for line in format_table(figures).splitlines() if "later turns" in line]
    assert later == [f"{'Mean TTFT, later turns (ms):':<40}n/a"]


def test_one_turn_is_the_single_request_run() -> None:
    server = FakeServer()
    figures = asyncio.run(_bench(server))
    assert (figures["completed"], figures["turns"]) == (4, 1)
    assert all(
        "logprobs" not in r.body and "return_tokens_as_token_ids" not in r.body
        for r in server.received
    )
    plain = random_requests(4, 8, 3, range_ratio=0.0, vocab_size=VOCAB, seed=5)
    assert sorted(r.body["prompt"] for r in server.received) == sorted(
        r.prompt_token_ids for r in plain
    )
    assert figures["mean_ttft_first_turn_ms"] is None
    assert figures["mean_ttft_later_turns_ms"] is None
    assert "turn" not in format_table(figures)


def test_turn_ttfts_in_the_table() -> None:
    results = [
        RequestResult(success=True, output_tokens=2, ttft=0.3, latency=0.5, turn=1),
        RequestResult(success=True, output_tokens=2, ttft=0.1, latency=0.2, turn=2),
        RequestResult(success=True, output_tokens=2, ttft=0.2, latency=0.3, turn=3),
        RequestResult(success=False, error="HTTP 400", turn=2),
    ]
    f = summarize(results, duration=1.0) | {"turns": 3}
    assert f["mean_ttft_first_turn_ms"] == pytest.approx(300.0)
    assert f["mean_ttft_later_turns_ms"] == pytest.approx(150.0)
    lines = format_table(f).splitlines()
    at = lines.index(next(line for line in lines if line.startswith("P99 TTFT")))
    assert lines[at + 1].split() == ["Turns", "per", "conversation:", "3"]
    assert lines[at + 2].startswith("Mean TTFT, turn 1 (ms):") and "300.00" in lines[at + 2]
    assert lines[at + 3].startswith("Mean TTFT, later turns (ms):") and "150.00" in lines[at + 3]
    assert lines[at + 4].startswith("Prefix cache hit rate:")


@pytest.mark.parametrize(
    ("value", "message"),
    [("0", "must be >= 1, got 0"), ("-3", "must be >= 1, got -3"), ("two", "invalid int")],
)
def test_turns_must_be_at_least_one(
    value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = build_parser()
    serve = ["bench", "serve", "--base-url", "http://127.0.0.1:1"]
    default, four = (parser.parse_args([*serve, *more]).turns for more in ([], ["--turns", "4"]))
    assert (default, four) == (1, 4)
    with pytest.raises(SystemExit, match="2"):
        parser.parse_args([*serve, "--turns", value])
    assert f"argument --turns: {message}" in capsys.readouterr().err
