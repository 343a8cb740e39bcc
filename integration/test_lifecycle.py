"""Health, API keys, client disconnects and graceful shutdown, on real server processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
from harness import MODEL_NAME, Server, ServerFactory


def test_health(server: Server) -> None:
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_disconnect_mid_stream_aborts_and_frees_blocks(server: Server) -> None:
    before = _aborted(server)
    body = {
        "model": MODEL_NAME,
        "prompt": "hello",
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    url = f"{server.base_url}/v1/completions"
    # Leaving the block closes the connection mid-stream.
    with httpx.Client(timeout=30) as client, client.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
    server.wait_idle()
    assert _aborted(server) == before + 1


def _aborted(server: Server) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    for line in text.splitlines():
        if line.startswith("tandem:request_success_total") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_api_key(start_server: ServerFactory) -> None:
    server = start_server("--api-key", "sekret", real_process=True)
    url = f"{server.base_url}/v1/models"
    missing = httpx.get(url)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer sekret"}).status_code == 200
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert server.stop() == 0


def test_sigterm_with_a_stream_in_flight_exits_cleanly(start_server: ServerFactory) -> None:
    server = start_server(real_process=True)
    body = {
        "model": MODEL_NAME,
        "prompt": "hello",
        "max_tokens": 450,
        "stream": True,
        "ignore_eos": True,
    }
    seen: list[str] = []
    started = threading.Event()

    def stream() -> None:
        with httpx.Client(timeout=60) as client:
            try:
                with client.stream(
                    "POST", f"{server.base_url}/v1/completions", json=body
                ) as response:
                    for line in response.iter_lines():
                        seen.append(line)
                        started.set()
            except httpx.HTTPError:
                pass
        started.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(30)
    assert server.stop(signal.SIGTERM) == 0
    thread.join(30)
    assert not thread.is_alive()
    assert seen  # the stream was running when the signal came
    # The port is released: nothing answers any more.
    try:
        httpx.get(f"{server.base_url}/health", timeout=2)
        raise AssertionError("the server still answers after SIGTERM")
    except httpx.HTTPError:
        pass


def test_sigint_exits_cleanly(start_server: ServerFactory) -> None:
    assert start_server(real_process=True).stop(signal.SIGINT) == 0


def test_bench_serve_completes(server: Server, tmp_path: Path) -> None:
    result_json = tmp_path / "bench.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.server.cli.main",
            "bench",
            "serve",
            "--base-url",
            server.base_url,
            "--num-prompts",
            "16",
            "--max-concurrency",
            "8",
            "--input-len",
            "32",
            "--output-len",
            "8",
            "--range-ratio",
            "0.25",
            "--ignore-eos",
            "--num-warmups",
            "2",
            "--result-json",
            str(result_json),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "Serving Benchmark Result" in done.stdout
    import json

    figures = json.loads(result_json.read_text())
    assert figures["completed"] == 16 and figures["failed"] == 0
    assert figures["total_output_tokens"] >= 16 * 6
    assert figures["mean_ttft_ms"] > 0 and figures["mean_tpot_ms"] > 0
    server.wait_idle()
