"""The benchmark's client: SSE payloads from pieces cut anywhere, and one streamed request
timed against a real HTTP server (aiohttp's), errors included."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web

from tandem.server.bench.client import RequestResult, send_completion, sse_data
from tandem.server.bench.dataset import BenchRequest

STREAM = (
    b": a comment\n\n"
    b'data: {"choices": [{"text": "a"}]}\n\n'
    b"event: ping\n\n"
    b'data: {"choices": [{"text": "' + b"x" * 200_000 + b'"}]}\n\n'
    b'data:{"choices": [{"text": ""}], "usage": {"completion_tokens": 2, "prompt_tokens": 3}}\n\n'
    b"data: [DONE]"
)


async def _pieces(data: bytes, size: int) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


async def _collect(data: bytes, size: int) -> list[bytes]:
    return [payload async for payload in sse_data(_pieces(data, size))]


def test_sse_payloads_do_not_depend_on_where_the_socket_cuts() -> None:
    expected = asyncio.run(_collect(STREAM, size=len(STREAM)))
    assert len(expected) == 4 and expected[-1] == b"[DONE]"
    assert json.loads(expected[1])["choices"][0]["text"] == "x" * 200_000
    for size in (1, 7, 64, 4096):
        assert asyncio.run(_collect(STREAM, size=size)) == expected


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _send(session: aiohttp.ClientSession, port: int, output_len: int) -> RequestResult:
    return await send_completion(
        session,
        f"http://127.0.0.1:{port}/v1/completions",
        model="m",
        request=BenchRequest(prompt_token_ids=[5, 6, 7], output_len=output_len),
        ignore_eos=True,
        headers={},
    )


async def _run_against(handler: Handler) -> tuple[RequestResult, dict[str, object]]:
    seen: dict[str, object] = {}

    async def recording(request: web.Request) -> web.StreamResponse:
        seen.update(await request.json())
        return await handler(request)

    app = web.Application()
    app.router.add_post("/v1/completions", recording)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as session:
            result = await _send(session, port, output_len=2)
    finally:
        await runner.cleanup()
    return result, seen


async def _streamed(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for text in ("a", "b"):
        await response.write(f'data: {{"choices": [{{"text": "{text}"}}]}}\n\n'.encode())
        await asyncio.sleep(0.05)
    usage = {"completion_tokens": 2, "prompt_tokens": 3}
    await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    return response


def test_a_streamed_request_is_timed_and_counted() -> None:
    result, sent = asyncio.run(_run_against(_streamed))
    assert result.success and result.error == ""
    assert (result.prompt_tokens, result.output_tokens) == (3, 2)
    assert len(result.itl) == 1 and result.itl[0] >= 0.04
    assert 0 < result.ttft < result.latency
    assert sent["prompt"] == [5, 6, 7] and sent["stream"] is True and sent["ignore_eos"] is True


async def _refused(request: web.Request) -> web.StreamResponse:
    return web.json_response({"error": {"message": "max_tokens too large"}}, status=400)


async def _error_in_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b'data: {"error": {"message": "the engine failed"}}\n\n')
    return response


async def _cut_short(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b'data: {"choices": [{"text": "a"}]}\n\n')
    return response


def test_failures_come_back_as_errors_not_exceptions() -> None:
    refused, _ = asyncio.run(_run_against(_refused))
    assert not refused.success and refused.error.startswith("HTTP 400")
    assert "max_tokens too large" in refused.error
    failed, _ = asyncio.run(_run_against(_error_in_stream))
    assert not failed.success and failed.error == "the engine failed"
    short, _ = asyncio.run(_run_against(_cut_short))
    assert not short.success and "without usage" in short.error


async def _on_dropped_keepalive(first: int = 1) -> tuple[list[RequestResult], list[int]]:
    """``first`` requests at once, then one more, against a server that answers one request
    per connection and closes a connection when a second request arrives on it, without an
    answer: every connection a pooled client reuses is one the server has dropped."""
    arrivals: list[int] = []
    answer = (
        b'data: {"choices": [{"text": "a"}]}\n\n'
        b'data: {"choices": [], "usage": {"completion_tokens": 1, "prompt_tokens": 3}}\n\n'
        b"data: [DONE]\n\n"
    )

    opened: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = len(opened)
        opened.append(connection)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.lower().split(b"\r\n")
                    if line.startswith(b"content-length:")
                )
                await reader.readexactly(length)
                arrivals.append(connection)
                if arrivals.count(connection) > 1:
                    return
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Keep-Alive: timeout=5\r\nContent-Length: %d\r\n\r\n" % len(answer) + answer
                )
                await writer.drain()
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    results = []
    async with server, aiohttp.ClientSession() as session:
        results += await asyncio.gather(*(_send(session, port, 1) for _ in range(first)))
        results.append(await _send(session, port, output_len=1))
    return results, arrivals


def test_a_request_on_a_connection_the_server_dropped_is_sent_again() -> None:
    results, arrivals = asyncio.run(_on_dropped_keepalive())
    assert [r.error for r in results] == ["", ""]
    assert all(r.success and r.output_tokens == 1 for r in results)
    # The second request reached the first connection, which the server dropped, and was
    # answered on a second one.
    assert arrivals == [0, 0, 1]


def test_a_resent_request_does_not_take_another_dropped_connection() -> None:
    """Three connections pooled, all dropped: the request sent again goes out on a new one
    (not the next pooled one), so one resend is enough however many the pool holds."""
    results, arrivals = asyncio.run(_on_dropped_keepalive(first=3))
    assert [r.error for r in results] == ["", "", "", ""]
    assert len(arrivals) == 5 and arrivals[-1] == 3  # one reused, then a fourth connection
