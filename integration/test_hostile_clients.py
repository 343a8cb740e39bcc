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
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "hostile_clients.py"

pytestmark = pytest.mark.slow

EXPECTED = {
    # The prompt fits the byte bound of the long-context demo model: tokenized.
    "tokenize-huge-prompt": {"200"},
    # 15,000 messages: tokenized, or too long for the context or the template's time.
    "tokenize-many-messages": {"200", "400"},
    "chat-many-messages": {"400"},
    "unknown-model-huge-body": {"404"},
}


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
