"""Hostile clients at CI size (benchmarks/hostile_clients.py): while four clients at a time
send huge /tokenize prompts, huge chat-message lists (through /tokenize and the chat API)
and huge bodies for an unknown model, a stream keeps going, every attack gets its answer and
the server gives back the memory the attacks took.

The timing bounds of issue 35 (a stream's largest gap <= 250 ms, /health <= 100 ms) are the
benchmark's figures, printed here: on a loaded 2-core CI machine the stream's gap at rest
already reaches them, so this test holds only what does not depend on the machine's load:
the statuses, the memory, and stalls bounded far below the seconds the old code froze for
(15.9 s at the full sizes, 3-5 s at these)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from harness import MODEL_NAME, SPEC, ServerFactory

from tandem.core.demo.demo_model import write_demo_model
from tandem.core.llm.tokenizer import Tokenizer
from tandem.server.preparer import PROCESS_BODY_BYTES

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "hostile_clients.py"


EXPECTED = {
    # The prompt fits the byte bound of the long-context demo model: tokenized, then answered,
    # or refused by the --max-tokenize-tokens budget when it makes more tokens than that.
    "tokenize-huge-prompt": {"200", "400"},
    # 15,000 messages: tokenized, or too long for the context or the template's time.
    "tokenize-many-messages": {"200", "400"},
    "chat-many-messages": {"400"},
    "unknown-model-huge-body": {"404"},
}


@pytest.mark.slow
def test_no_client_freezes_another(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    print(done.stdout)
    results = {r["attack"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == set(EXPECTED)
    for name, r in results.items():
        assert set(r["statuses"]) <= EXPECTED[name], (name, r["statuses"])
        assert sum(r["statuses"].values()) == r["clients"]
        # The stream went on through the attack, and nothing froze the server for seconds.
        assert r["stream_tokens"] > 0, name
        assert r["max_gap_ms"] < 2500, (name, r["max_gap_ms"])
        assert r["max_health_ms"] < 2500, (name, r["max_health_ms"])
        # The memory an attack took is given back: the server's own, and its preparation
        # processes' with it.
        assert r["rss_after_mib"] <= 1.15 * r["rss_before_mib"], (name, r)
        assert r["total_rss_after_mib"] <= 1.15 * r["total_rss_before_mib"], (name, r)


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
