"""Hostile clients at CI size (benchmarks/hostile_clients.py): every attack class of issue 35
(huge prompts with and without the key, the largest prompt the budget admits, huge chat
message lists, huge bodies for an unknown model, completions with huge prompts, /detokenize
of many ids, unbuildable grammars, a deeply nested schema, 320,000 sequences, a short
request behind heavy preparation with --request-timeout-s 3, idle and trickling
connections with the open-file limit at 64) runs against a live server while a stream
keeps going: every attack gets the answer expected, the stream and /health never stall for
long, and the server gives back the memory the attacks took.

The timing bounds of issue 35 (a stream's largest gap <= 250 ms, /health <= 100 ms) are the
benchmark's figures, printed here: on a loaded 2-core CI machine the stream's gap at rest
already reaches them, so this test bounds the stalls relative to what the same stream shows
at rest before the attacks (see ``stall_bound_ms``), far below the seconds the old code
froze for."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import MODEL_NAME, SPEC, ServerFactory

from tandem.core.demo.demo_model import write_demo_model
from tandem.core.llm.tokenizer import Tokenizer
from tandem.server.preparer import PROCESS_BODY_BYTES
from tandem.server.state import ServerLimits

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "hostile_clients.py"


EXPECTED = {
    # No key: refused before the body is read.
    "tokenize-huge-prompt-no-key": {"401"},
    "tokenize-largest-prompt": {"200"},
    # Past the byte bound's reach but over --max-tokenize-tokens: tokenized (in a
    # preparation process), then refused.
    "tokenize-huge-prompt": {"400"},
    "completions-huge-prompt": {"400"},
    "detokenize-many-ids": {"200"},
    # 15,000 messages: over --max-chat-messages.
    "tokenize-many-messages": {"400"},
    "tokenize-most-messages": {"200"},
    "chat-many-messages": {"400"},
    "unknown-model-huge-body": {"404"},
    # Refused before the first token, every time (the old code: 500 mid-generation).
    "grammar-unbuildable-regex": {"400"},
    "deep-schema": {"400"},
    "many-sequences": {"400"},
    # The heavy requests end at the deadline (or are refused sooner); the short one behind
    # them is served (the old code: 504 after 11.6 s for a 3 s limit).
    "request-timeout": {"504", "400", "short 200"},
    # Trickles cut off by the header and body timeouts; a request while 60 idle connections
    # are open is answered (503 at the cap, or served), and served once they are closed.
    "idle-and-slow-connections": {
        "headers-trickle 408",
        "body-trickle 408",
        "during-idle 503",
        "during-idle 200",
        "after-idle 200",
    },
}


def stall_bound_ms(rest_gap_ms: float) -> float:
    """The largest stream gap (or /health latency) an attack may cause, given how large the
    stream's gaps are at rest on this machine. The same stream shows gaps of up to 250 ms at
    rest on a shared, loaded 2-core box (other jobs take the CPU), and an attack adds four
    clients and two preparation processes to that load, so a fixed 250 ms bound fails without
    any stall of the server's own. What the old code did is a freeze of seconds at these
    sizes (3-5 s, 15.9 s at the full ones): one second over three times the gap at rest
    catches that reliably."""
    return 1000 + 3 * rest_gap_ms


def machine_rest_gap_ms(results: dict[str, dict[str, Any]]) -> float:
    """The gap at rest that the bounds use: the largest of the run's one-second samples
    taken before each attack. One sample alone misjudges a busy machine: at load average 15
    one class measured 168 ms at rest, then saw a 1,961 ms gap during its 9 s attack with no
    stall of the server's (every other class of that run measured 171-792 ms at rest)."""
    return max(float(r["rest_gap_ms"]) for r in results.values())


@pytest.mark.slow
def test_no_client_freezes_another(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--settle-s", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    print(done.stdout)
    results = {r["attack"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == set(EXPECTED)
    rest_gap_ms = machine_rest_gap_ms(results)
    bound = stall_bound_ms(rest_gap_ms)
    for name, r in results.items():
        assert set(r["statuses"]) <= EXPECTED[name], (name, r["statuses"], r["notes"])
        if r["attack"] not in ("request-timeout", "idle-and-slow-connections"):
            assert sum(r["statuses"].values()) == r["clients"]
        # The stream went on through the attack, and nothing froze the server.
        assert r["stream_tokens"] > 0, name
        assert r["max_gap_ms"] < bound, (name, r["max_gap_ms"], rest_gap_ms)
        assert r["max_health_ms"] < bound, (name, r["max_health_ms"], rest_gap_ms)
        # The memory an attack took is given back: the server's own, and its preparation
        # processes' with it (measured from a full pool of them, so that a process started
        # during a class to replace a retired one is not counted as memory taken).
        assert r["processes_before"] == ServerLimits().prepare_processes, (name, r)
        assert r["rss_after_mib"] <= 1.15 * r["rss_before_mib"], (name, r)
        assert r["total_rss_after_mib"] <= 1.15 * r["total_rss_before_mib"], (name, r)
    assert results["request-timeout"]["statuses"].get("short 200") == 1
    connections = results["idle-and-slow-connections"]["statuses"]
    assert {"headers-trickle 408", "body-trickle 408", "after-idle 200"} <= set(connections)


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test model with a context long enough for 3,000 messages."""
    spec = replace(SPEC, max_position_embeddings=65_536)
    return write_demo_model(tmp_path_factory.mktemp("long-model"), spec)


def test_large_bodies_are_answered_as_small_ones(
    start_server: ServerFactory, long_model: Path
) -> None:
    """A body over the preparation processes' threshold gets the answers the server's own
    threads give: the same tokens, the same errors."""
    server = start_server(
        "--model", str(long_model), "--served-model-name", MODEL_NAME, demo_model=False
    )
    messages = [{"role": "user", "content": f"hello number {i}"} for i in range(3000)]
    many = [{"role": "user", "content": "hello " * 2000} for _ in range(40)]
    assert len(json.dumps(messages)) > PROCESS_BODY_BYTES
    got = httpx.post(
        f"{server.base_url}/tokenize", json={"model": MODEL_NAME, "messages": messages}, timeout=120
    )
    assert got.status_code == 200, got.text
    tokenizer = Tokenizer(long_model)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert got.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)

    chat = {"model": MODEL_NAME, "messages": many, "max_tokens": 2}
    too_long = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat, timeout=120)
    assert too_long.status_code == 400
    assert too_long.json()["error"]["param"] == "messages"
    assert "maximum context" in too_long.json()["error"]["message"]

    for body, status, param in [
        ({**chat, "temperature": "hot"}, 400, "temperature"),
        ({**chat, "model": "no-such-model"}, 404, "model"),
    ]:
        answer = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
        assert answer.status_code == status, answer.text
        assert answer.json()["error"]["param"] == param

    # A large body whose prompt fits: the padding is in a field the prompt does not read.
    fits = {
        **chat,
        "messages": messages[:2],
        "temperature": 0,
        "user": "x" * (PROCESS_BODY_BYTES + 1),
    }
    answer = httpx.post(f"{server.base_url}/v1/chat/completions", json=fits, timeout=120)
    small = httpx.post(
        f"{server.base_url}/v1/chat/completions", json={**fits, "user": "x"}, timeout=120
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"] == small.json()["usage"]
    assert answer.json()["choices"][0]["message"] == small.json()["choices"][0]["message"]

    # /v1/completions and /detokenize are prepared in a process too, with the same answers.
    pad = "x" * (PROCESS_BODY_BYTES + 1)
    prompts = [f"hello number {i}" for i in range(3)]
    completion = {"model": MODEL_NAME, "prompt": prompts, "max_tokens": 2, "temperature": 0}
    for extra in ({}, {"echo": True}, {"prompt": [[1, 2, 3], [4, 5]], "echo": True}):
        body = {**completion, **extra}
        large = httpx.post(f"{server.base_url}/v1/completions", json={**body, "user": pad},
                           timeout=120)  # fmt: skip
        small = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
        assert large.status_code == 200, large.text
        assert large.json()["choices"] == small.json()["choices"]
        assert large.json()["usage"] == small.json()["usage"]
    for body, status, param in [
        ({**completion, "model": "no-such-model"}, 404, "model"),
        ({**completion, "temperature": "hot"}, 400, "temperature"),
        ({**completion, "prompt": ["a"] * 20_000, "n": 16, "temperature": 1.0}, 400, "prompt"),
        ({**completion, "prompt": "hello " * 70_000}, 400, "prompt"),
    ]:
        answer = httpx.post(f"{server.base_url}/v1/completions", json={**body, "user": pad},
                            timeout=120)  # fmt: skip
        assert answer.status_code == status, answer.text
        assert answer.json()["error"]["param"] == param
    ids = tokenizer.encode("hello there " * 4000, add_special_tokens=False)
    assert len(json.dumps(ids)) > PROCESS_BODY_BYTES
    got = httpx.post(f"{server.base_url}/detokenize", json={"tokens": ids}, timeout=120)
    assert got.status_code == 200, got.text
    assert got.json()["prompt"] == tokenizer.decode(ids)
    bad = httpx.post(f"{server.base_url}/detokenize", json={"tokens": [*ids, 10**6]}, timeout=120)
    small_bad = httpx.post(f"{server.base_url}/detokenize", json={"tokens": [1, 10**6]})
    assert bad.status_code == small_bad.status_code == 400
    assert bad.json()["error"]["message"] == small_bad.json()["error"]["message"]
