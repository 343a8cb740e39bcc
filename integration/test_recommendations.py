"""A generative recommender behind the real server: ``tandem make-demo-model --kind rec``, then
``tandem serve`` with two devices in one process and two pipeline lanes; ranked candidates
over HTTP, OpenAI-style errors for bad input, the server still serving after each."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from harness import Server, ServerFactory

from tandem.core.models.rec_config import load_rec_config

NAME = "rec-demo"


@pytest.fixture(scope="module")
def rec_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("rec") / "model"
    done = subprocess.run(
        [sys.executable, "-m", "tandem.server.cli.main", "make-demo-model", "--kind", "rec",
         str(folder)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return folder


@pytest.fixture(scope="module")
def rec_server(start_server: ServerFactory, rec_dir: Path) -> Server:
    return start_server(
        "--model", str(rec_dir), "--served-model-name", NAME, "--devices", "cpu:0,cpu:1",
        "--single-process", "--max-concurrency", "2", "--rec-max-batch-size", "4",
    )  # fmt: skip


def _post(server: Server, body: object) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/recommendations", json=body, timeout=60)


def test_ranked_candidates_over_http(rec_server: Server, rec_dir: Path) -> None:
    models = httpx.get(f"{rec_server.base_url}/v1/models", timeout=10).json()["data"]
    assert models[0]["id"] == NAME and models[0]["kind"] == "generative-recommender"
    config = load_rec_config(rec_dir)
    history = [[i % config.codebook_size, (3 * i) % config.codebook_size, 7] for i in range(20)]
    reply = _post(rec_server, {"model": NAME, "history": history, "num_candidates": 5})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "recommendation" and body["model"] == NAME
    candidates = body["candidates"]
    assert len(candidates) == 5
    assert all(len(c["item"]) == config.num_codebooks for c in candidates)
    scores = [c["score"] for c in candidates]
    assert scores == sorted(scores, reverse=True)
    # The same request gives the same answer (batched with others or not).
    same = {"model": NAME, "history": history, "num_candidates": 5}
    with ThreadPoolExecutor(8) as pool:
        again = list(pool.map(lambda _: _post(rec_server, same), range(8)))
    items = [c["item"] for c in candidates]
    for r in again:
        # Batched with other requests or alone: the same items; scores to float rounding
        # (another batch shape may round the last bit differently).
        got = r.json()["candidates"]
        assert [c["item"] for c in got] == items
        assert [c["score"] for c in got] == pytest.approx(scores, abs=1e-4)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": NAME, "history": [], "num_candidates": 3}, 400, "history"),
        ({"model": NAME, "history": [[1, 2]], "num_candidates": 3}, 400, "history"),
        ({"model": NAME, "history": [[1, 2, 99999]], "num_candidates": 3}, 400, "history"),
        ({"model": NAME, "history": [[1, 2, 3]], "num_candidates": 0}, 400, "num_candidates"),
        ({"model": NAME, "history": [[1, 2, 3]], "num_candidates": 100000}, 400, "num_candidates"),
        ({"model": NAME, "history": "items", "num_candidates": 3}, 400, "history"),
        ({"model": NAME, "history": [[1, 2, 3.5]]}, 400, "history"),
        ({"model": NAME, "history": [[1, 2, 3]] * 10000}, 400, "history"),
        ({"history": [[1, 2, 3]]}, 400, "model"),
        ({"model": "other", "history": [[1, 2, 3]]}, 404, "model"),
    ],
)
def test_bad_requests_get_openai_errors(
    rec_server: Server, body: dict[str, object], status: int, param: str
) -> None:
    reply = _post(rec_server, body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"]
    good = _post(rec_server, {"model": NAME, "history": [[1, 2, 3]], "num_candidates": 2})
    assert good.status_code == 200


def test_health_and_metrics(rec_server: Server) -> None:
    assert httpx.get(f"{rec_server.base_url}/health", timeout=10).status_code == 200
    _post(rec_server, {"model": NAME, "history": [[1, 2, 3]], "num_candidates": 2})
    text = httpx.get(f"{rec_server.base_url}/metrics", timeout=10).text
    assert 'tandem:rec_requests_total{model_name="rec-demo",outcome="ok"}' in text
    assert rec_server.metric("tandem:kv_cache_usage_perc") == 0.0
