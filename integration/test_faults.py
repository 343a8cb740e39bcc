"""Injected faults (TANDEM_FAULTS) on real server processes, TP=2 in one process and in two:
every request in flight fails within 10 s with an OpenAI-shaped error naming the rank and
the cause, /health turns 503, new requests get 503, and the server exits non-zero (by
itself by default; on SIGTERM with --no-exit-on-engine-failure, which keeps it up to look
at). Every wait is bounded: a hang fails the test on its timeout."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import MODEL_NAME, Server, ServerFactory, free_port

from tandem.core.demo.rec_demo_model import tiny_rec_spec, write_rec_demo_model
from tandem.server.supervision import EXIT_ENGINE_FAILED

# fault -> (TANDEM_FAULTS, extra flags, what every failed request's error must say)
FAULTS = {
    "forward_raise": ("forward_raise:rank=1,step=10", [], "rank 1 (cpu:1) failed: InjectedFault"),
    "forward_delay": (
        "forward_delay:rank=1,step=10,seconds=120",
        ["--step-timeout-s", "3"],
        "rank 1 (cpu:1) did not finish the step",
    ),
    "collective_fail": (
        "collective_fail:rank=1,step=10,collective=1",
        [],
        "rank 1 (cpu:1) failed: CollectiveError: injected fault",
    ),
    "kernel_registration_fail": (
        "kernel_registration_fail:rank=1",
        [],
        "rank 1 (cpu:1) failed: InjectedFault: injected fault: registering kernel",
    ),
    "kv_exhaust": ("kv_exhaust:step=10", ["--stall-timeout-s", "2"], "could not schedule"),
}
FAIL_WITHIN_S = 10.0
EXIT_WITHIN_S = 30.0


def _topology(name: str) -> tuple[list[str], dict[str, str]]:
    pair = ["--devices", "cpu:0,cpu:1"]
    if name == "single-process":
        return pair, {"TANDEM_ENABLE_SINGLE_PROCESS": "1"}
    return [*pair, "--master-node-addr", f"127.0.0.1:{free_port()}"], {}


@dataclass
class Answer:
    status: int
    # The error's message: the body's for a plain answer, the last event's for a stream.
    error: str | None
    # A stream ended with [DONE].
    done: bool


def _request(server: Server, index: int) -> Answer:
    """One long request: completions or chat, streamed or not, by ``index``."""
    stream = index % 2 == 1
    body: dict[str, object] = {"model": MODEL_NAME, "max_tokens": 300, "ignore_eos": True,
                               "stream": stream}  # fmt: skip
    if index % 4 < 2:
        path, body["prompt"] = "/v1/completions", f"request {index}"
    else:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": "hi"}]
    with httpx.Client(timeout=FAIL_WITHIN_S + 20) as client:
        if not stream:
            response = client.post(server.base_url + path, json=body)
            error = response.json().get("error") if response.status_code != 200 else None
            return Answer(response.status_code, error and error["message"], done=False)
        with client.stream("POST", server.base_url + path, json=body) as response:
            if response.status_code != 200:
                error = json.loads(response.read())["error"]["message"]
                return Answer(response.status_code, error, done=False)
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    events = [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
    last_event: dict[str, Any] = events[-1] if events else {}
    error = last_event.get("error")
    return Answer(response.status_code, error and error["message"], lines[-1] == "data: [DONE]")


def _fail_requests(server: Server, expected: str) -> None:
    started = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: _request(server, i), range(4)))
    took = time.monotonic() - started
    assert took < FAIL_WITHIN_S + 5, f"the requests took {took:.1f} s to fail"
    for index, answer in enumerate(answers):
        assert answer.error is not None and expected in answer.error, (index, answer)
        assert "/" not in answer.error, f"the error leaks a path: {answer.error}"
        if answer.status == 503:
            continue  # it came after the engine had failed: refused, saying why
        if index % 2:  # streamed: an error event, then [DONE]
            assert answer.status == 200 and answer.done, (index, answer)
        else:
            assert answer.status == 500, (index, answer)
    in_flight = [a for a in answers if a.status != 503]
    assert in_flight, "no request was in flight when the fault struck"


def _wait_exit(server: Server, within: float) -> int:
    try:
        return server.process.wait(within)
    except subprocess.TimeoutExpired:
        server.process.kill()
        raise AssertionError(f"the server did not exit within {within} s") from None


@pytest.mark.parametrize("topology", ["single-process", "multi-process"])
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_an_injected_fault_fails_requests_turns_health_503_and_exits(
    start_server: ServerFactory, fault: str, topology: str
) -> None:
    spec, flags, expected = FAULTS[fault]
    args, env = _topology(topology)
    server = start_server(*args, *flags, "--no-exit-on-engine-failure",
                          env={**env, "TANDEM_FAULTS": spec}, real_process=True)  # fmt: skip
    _fail_requests(server, expected)
    health = httpx.get(f"{server.base_url}/health", timeout=10)
    assert health.status_code == 503
    message = health.json()["error"]["message"]
    assert expected in message and message.count("The engine is not running") == 1, message
    late = httpx.post(f"{server.base_url}/v1/completions", timeout=10,
                      json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2})  # fmt: skip
    assert late.status_code == 503 and expected in late.json()["error"]["message"]
    server.process.send_signal(signal.SIGTERM)
    assert _wait_exit(server, EXIT_WITHIN_S) == EXIT_ENGINE_FAILED


@pytest.mark.parametrize("topology", ["single-process", "multi-process"])
def test_by_default_a_failed_engine_drains_and_exits_non_zero_by_itself(
    start_server: ServerFactory, topology: str
) -> None:
    spec, flags, expected = FAULTS["forward_raise"]
    args, env = _topology(topology)
    server = start_server(*args, *flags, env={**env, "TANDEM_FAULTS": spec}, real_process=True)
    _fail_requests(server, expected)
    assert _wait_exit(server, EXIT_WITHIN_S) == EXIT_ENGINE_FAILED
    assert "the engine failed" in server.log.read_text()


@pytest.fixture(scope="module")
def rec_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_rec_demo_model(tmp_path_factory.mktemp("rec"), tiny_rec_spec())


REC_FAULTS = {
    "collective_fail": ("collective_fail:rank=1,step=4", "rank 1 (cpu:1) failed: CollectiveError"),
    "kv_exhaust": ("kv_exhaust:step=1", "could not admit"),
}


@pytest.mark.parametrize("fault", sorted(REC_FAULTS))
def test_a_fault_in_the_recommender_fails_its_requests_and_exits(
    start_server: ServerFactory, rec_model: Path, fault: str
) -> None:
    spec, expected = REC_FAULTS[fault]
    server = start_server(
        "--model", str(rec_model), "--served-model-name", "rec", "--devices", "cpu:0,cpu:1",
        "--max-concurrency", "2", "--rec-max-batch-size", "2",
        env={"TANDEM_ENABLE_SINGLE_PROCESS": "1", "TANDEM_FAULTS": spec}, real_process=True,
    )  # fmt: skip
    body = {"model": "rec", "history": [[1, 2, 3]] * 20, "num_candidates": 3}

    def recommend(_: int) -> httpx.Response:
        return httpx.post(f"{server.base_url}/v1/recommendations", json=body, timeout=30)

    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(recommend, range(8)))
    assert time.monotonic() - started < FAIL_WITHIN_S + 5
    failed = [a for a in answers if a.status_code != 200]
    assert failed, "no request saw the fault"
    for answer in failed:
        assert answer.status_code in (500, 503), answer.text
        assert expected in answer.json()["error"]["message"], answer.text
    assert _wait_exit(server, EXIT_WITHIN_S) == EXIT_ENGINE_FAILED
