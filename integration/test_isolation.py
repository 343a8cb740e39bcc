"""Isolation (issue 35) on real server processes: a request without the key does no work,
not even reading its body; connections that send nothing, or trickle their headers, are cut
off; with the open-file limit at 64, idle connections cannot take every descriptor: past the
connection cap new ones get 503 at once, and the log says why."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from harness import MODEL_NAME, Server, ServerFactory

HEADER_TIMEOUT = "1"


@pytest.fixture(scope="module")
def keyed(start_server: ServerFactory) -> Server:
    return start_server("--api-key", "secret", "--request-header-timeout-s", HEADER_TIMEOUT)


def _address(server: Server) -> tuple[str, int]:
    parts = urlsplit(server.base_url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def _read_response(sock: socket.socket) -> str:
    """One response, headers and body (by its content-length), without waiting for EOF."""
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(65536)
        if not chunk:
            break
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length and (chunk := sock.recv(65536)):
        body += chunk
    return (head + b"\r\n\r\n" + body).decode()


def _read_all(sock: socket.socket) -> bytes:
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/v1/completions"])
def test_without_the_key_the_answer_is_401_before_the_body_is_read(
    keyed: Server, path: str
) -> None:
    """The issue's case: /tokenize of a 6 MB prompt without the key did the work. Here the
    body is announced and never sent: reading it would wait for the body timeout (30 s)."""
    with socket.create_connection(_address(keyed), timeout=10) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            "content-length: 6000000\r\n\r\n".encode()
        )
        started = time.monotonic()
        answer = _read_response(sock)
    assert answer.startswith("HTTP/1.1 401"), answer
    assert '"invalid_api_key"' in answer
    assert time.monotonic() - started < 2
    with_key = {"authorization": "Bearer secret"}
    assert httpx.post(f"{keyed.base_url}/tokenize", json={"prompt": "hi"}).status_code == 401
    answer_ok = httpx.post(f"{keyed.base_url}/tokenize", json={"prompt": "hi"}, headers=with_key)
    assert answer_ok.status_code == 200
    assert httpx.get(f"{keyed.base_url}/health").status_code == 200
    assert httpx.get(f"{keyed.base_url}/metrics").status_code == 200
    assert httpx.get(f"{keyed.base_url}/v1/models").status_code == 401


def test_headers_trickled_one_byte_at_a_time_are_cut_off(keyed: Server) -> None:
    request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200 + b"\r\n\r\n"
    with socket.create_connection(_address(keyed), timeout=10) as sock:
        started = time.monotonic()
        try:
            for byte in request:
                sock.sendall(bytes([byte]))
                time.sleep(0.05)
        except (BrokenPipeError, ConnectionResetError):
            pass
        else:
            pytest.fail("the server let the headers trickle for 10 s")
        answer = _read_all(sock).decode()
    assert time.monotonic() - started < 4
    assert answer.startswith("HTTP/1.1 408"), answer
    assert "--request-header-timeout-s" in answer


def test_a_connection_that_sends_nothing_is_closed(keyed: Server) -> None:
    with socket.create_connection(_address(keyed), timeout=10) as sock:
        started = time.monotonic()
        assert _read_all(sock) == b""
    assert time.monotonic() - started < 4


def test_idle_connections_cannot_take_every_descriptor(start_server: ServerFactory) -> None:
    """The issue's case: with the open-file limit at 64, 60 connections that send nothing
    held every descriptor and requests were dropped unanswered, the log silent."""
    server = start_server("--request-header-timeout-s", "3", nofile=64)
    log = server.log.read_text()
    assert "accepting at most" in log and "open-file limit is 64" in log, log
    idle = [socket.create_connection(_address(server), timeout=10) for _ in range(60)]
    try:
        # (The refused ones past what the reserve can answer at once were closed at once;
        # those answered are held open by this test for a second, then closed.)
        time.sleep(1.5)
        # A request now is answered: 503 at once with Connection: close, never dropped.
        answers = []
        for _ in range(3):
            try:
                response = httpx.get(f"{server.base_url}/health", timeout=5)
            except httpx.HTTPError as exc:
                pytest.fail(f"a request was dropped without an answer: {exc!r}")
            answers.append(response)
        for response in answers:
            assert response.status_code in (200, 503)
            if response.status_code == 503:
                assert response.headers["connection"] == "close"
                assert "--max-connections" in response.json()["error"]["message"]
        assert any(r.status_code == 503 for r in answers)
        assert "refusing connections with 503" in server.log.read_text()
        # Once the header timeout closed the idle ones, requests are served again.
        time.sleep(2.0)
        body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text
    finally:
        for sock in idle:
            sock.close()
