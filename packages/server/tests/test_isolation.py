"""Isolation (issue 35), in-process: no work without the key, budgets refused up front with a
400 that names the flag, and a request timeout that counts from arrival, preparation
included. Connection-level cases (header deadlines, the connection cap) are in
integration/test_isolation.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar, cast

import httpx
import pytest
from starlette.types import Message, Receive, Scope, Send

from tandem.core import CacheConfig, EngineConfig, EngineLoop, LLMEngine, ModelLoadConfig
from tandem.core.demo.demo_model import tiny_spec, write_demo_model
from tandem.server.app import ApiKeyMiddleware, create_app
from tandem.server.body_buffer import Spilled
from tandem.server.connections import connection_cap
from tandem.server.metrics import ServerMetrics
from tandem.server.prepare_worker import Answer
from tandem.server.preparer import RequestPreparer
from tandem.server.state import ServerLimits, ServerState

SPEC = replace(tiny_spec(), num_layers=1, vocab_size=400, max_position_embeddings=512)
T = TypeVar("T")
Client = httpx.AsyncClient
COMPLETION = {"model": "m", "prompt": "hello", "max_tokens": 1}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("m"), SPEC)


AppRunner = Callable[..., Any]


@pytest.fixture
def run_app(model: Path) -> Iterator[AppRunner]:
    loops: list[EngineLoop] = []

    def run(
        scenario: Callable[[Client, ServerState], Awaitable[T]],
        limits: ServerLimits | None = None,
        preparer_threads: int = 4,
    ) -> T:
        engine = LLMEngine(
            EngineConfig(model=ModelLoadConfig(model=str(model)), cache=CacheConfig(num_blocks=64))
        )
        metrics = ServerMetrics(engine, "m")
        loop = EngineLoop(engine, on_finished=metrics.observe_finished)
        loops.append(loop)
        state = ServerState(
            loop=loop,
            served_model_name="m",
            metrics=metrics,
            limits=limits or ServerLimits(),
            preparer=RequestPreparer(threads=preparer_threads),
        )
        app = create_app(state)

        async def go() -> T:
            transport = httpx.ASGITransport(app=app)
            async with Client(transport=transport, base_url="http://app", timeout=60) as client:
                return await scenario(client, state)

        try:
            return asyncio.run(go())
        finally:
            state.preparer.shutdown()

    yield run
    for loop in loops:
        loop.stop()


def _error(response: httpx.Response, status: int, param: str | None = None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    message: str = error["message"]
    return message


# ---- authentication ----------------------------------------------------------------------


def _through_key_check(path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, bool, bool]:
    """(status sent, whether the app behind was called, whether the body was read)."""
    called = read = False
    sent: list[Message] = []

    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal called
        called = True
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive() -> Message:
        nonlocal read
        read = True
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    scope: Scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    asyncio.run(ApiKeyMiddleware(inner, api_key="secret")(scope, receive, send))
    return sent[0]["status"], called, read


@pytest.mark.parametrize(
    "path",
    ["/tokenize", "/detokenize", "/v1/completions", "/v1/chat/completions", "/v1/models",
     "/openapi.json", "/unknown", "/V1/models", "/health/x"],
)  # fmt: skip
def test_without_the_key_no_route_does_any_work_not_even_reading_the_body(path: str) -> None:
    status, called, read = _through_key_check(path, [])
    assert (status, called, read) == (401, False, False)
    wrong = [(b"authorization", b"Bearer other")]
    assert _through_key_check(path, wrong) == (401, False, False)
    right = [(b"authorization", b"Bearer secret")]
    assert _through_key_check(path, right) == (200, True, False)


@pytest.mark.parametrize("path", ["/health", "/metrics"])
def test_health_and_metrics_answer_without_the_key(path: str) -> None:
    assert _through_key_check(path, []) == (200, True, False)


# ---- budgets ------------------------------------------------------------------------------


def test_budgets_are_refused_up_front_naming_the_limit_and_the_flag(run_app: AppRunner) -> None:
    async def scenario(client: Client, state: ServerState) -> None:
        started = time.monotonic()
        # The case, 320,000 sequences: a 400 before anything is tokenized.
        many = {**COMPLETION, "prompt": ["a"] * 20_000, "n": 16, "temperature": 1.0}
        message = _error(await client.post("/v1/completions", json=many), 400, "prompt")
        assert "320000 sequences" in message and "--max-sequences-per-request" in message
        assert "1024" in message
        just_over = {**COMPLETION, "prompt": ["a"] * 257, "n": 4, "temperature": 1.0}
        _error(await client.post("/v1/completions", json=just_over), 400, "prompt")
        assert time.monotonic() - started < 5
        chat = {**CHAT, "messages": [{"role": "user", "content": "hi"}] * 10_001}
        message = _error(await client.post("/v1/chat/completions", json=chat), 400, "messages")
        assert "--max-chat-messages" in message and "10000" in message
        tokenize = {"messages": chat["messages"]}
        message = _error(await client.post("/tokenize", json=tokenize), 400, "messages")
        assert "--max-chat-messages" in message
        # Within the budgets, all is as before.
        ok = {**COMPLETION, "prompt": ["a"] * 4, "n": 2, "temperature": 1.0}
        response = await client.post("/v1/completions", json=ok)
        assert response.status_code == 200 and len(response.json()["choices"]) == 8

    run_app(scenario)


def test_tokenize_is_bounded_by_size_before_the_work_and_by_tokens_after(
    run_app: AppRunner,
) -> None:
    limits = ServerLimits(max_tokenize_tokens=50, max_sequences_per_request=3)

    async def scenario(client: Client, state: ServerState) -> None:
        engine = state.engine
        encoded: list[int] = []
        encode = engine.tokenizer.encode

        def counting(text: str, *args: Any, **kwargs: Any) -> list[int]:
            encoded.append(len(text))
            return encode(text, *args, **kwargs)

        engine.tokenizer.encode = counting  # type: ignore[method-assign]
        huge = "tandem " * 200_000  # 1.4 MB
        message = _error(await client.post("/tokenize", json={"prompt": huge}), 400, "prompt")
        assert "bytes long" in message and "--max-tokenize-tokens" in message
        assert encoded == [], "the size alone should have refused it"
        # Small enough to pass the size bound, but more than 50 tokens.
        some = "tandem " * 60
        message = _error(await client.post("/tokenize", json={"prompt": some}), 400, "prompt")
        assert "tokens per request (--max-tokenize-tokens)" in message
        # Under the size bound but far over 50 tokens: a prefix's tokens refuse it.
        encoded.clear()
        large = "tandem " * 350
        message = _error(await client.post("/tokenize", json={"prompt": large}), 400, "prompt")
        assert "The prompt is at least" in message and "(--max-tokenize-tokens)" in message
        assert encoded and max(encoded) < len(large) // 3, encoded
        # So is one with no space to cut the prefix at.
        encoded.clear()
        digits = "2026" * 600
        message = _error(await client.post("/tokenize", json={"prompt": digits}), 400, "prompt")
        assert "The prompt is at least" in message and "(--max-tokenize-tokens)" in message
        assert encoded and max(encoded) < len(digits) // 3, encoded
        message = _error(await client.post("/detokenize", json={"tokens": [1] * 51}), 400)
        assert "--max-tokenize-tokens" in message
        assert (await client.post("/tokenize", json={"prompt": "tandem"})).status_code == 200
        # A flag lowers the sequence budget too: n=2 over two prompts is 4 > 3.
        body = {**COMPLETION, "prompt": ["a", "b"], "n": 2, "temperature": 1.0}
        message = _error(await client.post("/v1/completions", json=body), 400, "prompt")
        assert "2 prompts x n=2" in message
        message = _error(await client.post("/v1/chat/completions", json={**CHAT, "n": 4,
                         "temperature": 1.0}), 400, "n")  # fmt: skip
        assert "limit of 3" in message

    run_app(scenario, limits=limits)


# ---- the request timeout counts from arrival ----------------------------------------------


def test_a_request_waiting_for_preparation_gets_its_504_on_time(run_app: AppRunner) -> None:
    """The issue's case: a short request queued behind heavy preparation was answered 504
    only once the preparation it waited for had finished (11.6 s for a 3 s limit)."""
    limits = ServerLimits(request_timeout_s=0.5)

    async def scenario(client: Client, state: ServerState) -> None:
        release = threading.Event()
        # Someone else's heavy preparation holds the only preparer thread.
        heavy = asyncio.ensure_future(state.preparer.run(lambda: release.wait(10)))
        await asyncio.sleep(0.05)
        engine = state.engine
        encoded: list[str] = []
        encode = engine.inputs.encode_prompt

        def counting(text: str, *args: Any, **kwargs: Any) -> list[int]:
            encoded.append(text)
            return encode(text, *args, **kwargs)

        engine.inputs.encode_prompt = counting  # type: ignore[method-assign]
        for path, body in (
            ("/v1/completions", COMPLETION),
            ("/v1/chat/completions", CHAT),
            ("/tokenize", {"prompt": "hello"}),
        ):
            started = time.monotonic()
            message = _error(await client.post(path, json=body), 504)
            took = time.monotonic() - started
            assert "--request-timeout-s" in message
            assert took < 1.5, f"{path}: 504 after {took:.1f} s for a 0.5 s limit"
        release.set()
        await heavy
        # The preparation of the requests that timed out never ran.
        await state.preparer.run(lambda: None)
        assert encoded == []
        # And the server serves on.
        assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200

    run_app(scenario, limits=limits, preparer_threads=1)


def _preparing(text: str) -> float:
    found = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("tandem:preparation_jobs_running{")
    ]
    assert len(found) == 1, text
    return found[0]


def test_metrics_count_the_preparation_a_timed_out_request_left_running(
    run_app: AppRunner,
) -> None:
    """A request's 504 does not stop its preparation, which holds CPU and memory until it
    ends. /metrics counts it until then: without that, a measurement of the memory given back
    after an attack read the heaps of jobs still running (a flaky hostile-clients check)."""
    limits = ServerLimits(request_timeout_s=0.5)

    async def scenario(client: Client, state: ServerState) -> None:
        release = threading.Event()
        encode = state.engine.inputs.encode_prompt

        def slow(text: str, *args: Any, **kwargs: Any) -> list[int]:
            release.wait(10)
            return encode(text, *args, **kwargs)

        state.engine.inputs.encode_prompt = slow  # type: ignore[method-assign]
        assert _preparing((await client.get("/metrics")).text) == 0
        # Two at once on the one preparer thread: the second's job, still queued when its
        # request timed out, never starts and is not counted.
        both = await asyncio.gather(
            client.post("/v1/completions", json=COMPLETION),
            client.post("/v1/completions", json=COMPLETION),
        )
        for response in both:
            _error(response, 504)
        assert _preparing((await client.get("/metrics")).text) == 1
        release.set()
        deadline = time.monotonic() + 10
        while _preparing((await client.get("/metrics")).text) != 0:
            assert time.monotonic() < deadline, "the ended job is still counted"
            await asyncio.sleep(0.02)

    run_app(scenario, limits=limits, preparer_threads=1)


# ---- the connection cap -------------------------------------------------------------------


def test_the_connection_cap_stays_below_the_open_file_limit() -> None:
    cap, why = connection_cap(None, 128, 30)
    assert cap == 128 - 30 - 32 and "open-file limit is 128" in why and "ulimit -n" in why
    cap, why = connection_cap(None, 1_048_576, 200)
    assert cap == 1_048_576 - 200 - 1_048_576 // 8
    # A requested cap above what the limit allows is lowered, and the log says so.
    cap, why = connection_cap(1000, 128, 30)
    assert cap == 66 and "not --max-connections 1000" in why
    cap, why = connection_cap(8, 128, 30)
    assert (cap, why) == (8, "accepting at most 8 connections (--max-connections)")
    assert connection_cap(None, 64, 100)[0] == 1
    assert connection_cap(None, None, 30)[0] > 0


# ---- large bodies: prepared in a process, never in the server's heap -----------------------


class _FakeProcesses:
    """Stands in for the preparation processes: records each job and its body."""

    def __init__(self, answer: bytes) -> None:
        self.processes = object()
        self.jobs: list[tuple[str, bytes]] = []
        self.answer = answer

    async def run_in_process(self, job: str, body: Spilled) -> tuple[Answer, Spilled]:
        # The body reached here out of the heap, in a mapping of its own.
        assert isinstance(body, Spilled)
        with body.view() as raw:
            self.jobs.append((job, bytes(raw)))
        answer = Spilled(len(self.answer))
        answer.write(self.answer)
        return Answer(200, b"", body_size=len(self.answer)), answer


def _post_in_pieces(app: Any, path: str, body: bytes) -> tuple[int, bytes]:
    """POST ``body`` to the ASGI ``app`` in 64 KiB pieces, as the connection delivers it."""
    pieces = [body[i : i + (64 << 10)] for i in range(0, len(body), 64 << 10)]
    sent: list[Message] = []

    async def receive() -> Message:
        if pieces:
            piece = pieces.pop(0)
            return {"type": "http.request", "body": piece, "more_body": bool(pieces)}
        await asyncio.sleep(10)
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    headers = [(b"content-length", str(len(body)).encode())]
    scope: Scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


@pytest.mark.parametrize(
    ("path", "job"),
    [("/tokenize", "tokenize"), ("/detokenize", "detokenize"),
     ("/v1/completions", "completion"), ("/v1/chat/completions", "chat")],
)  # fmt: skip
def test_a_large_body_to_any_preparing_route_goes_to_a_process_out_of_the_heap(
    path: str, job: str
) -> None:
    """The issue's cases: a completion with a huge prompt or 20,000 prompts, or a
    /detokenize of a huge id list, were parsed and prepared on the server's own threads,
    holding its GIL; and every large body stayed in its heap for good."""
    from tandem.server.app import BodyLimitMiddleware
    from tandem.server.preparer import PROCESS_BODY_BYTES, PreparationMiddleware

    answer = b'{"tokens": [' + b"1, " * 100_000 + b"1]}"
    fake = _FakeProcesses(answer)
    reached: list[bytes] = []

    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        reached.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"inner"})

    app = BodyLimitMiddleware(PreparationMiddleware(inner, cast(Any, fake)), limit=8 << 20)
    large = json.dumps({"prompt": "x" * (PROCESS_BODY_BYTES + 10)}).encode()
    status, body = _post_in_pieces(app, path, large)
    assert (status, body) == (200, answer)
    assert fake.jobs == [(job, large)] and reached == []
    # A small body is prepared in the server, as before.
    small = json.dumps({"prompt": "x"}).encode()
    assert _post_in_pieces(app, path, small) == (200, b"inner")
    assert reached == [small] and len(fake.jobs) == 1
    # A large body to another route reaches it whole, as bytes.
    assert _post_in_pieces(app, "/v1/other", large) == (200, b"inner")
    assert reached[-1] == large
