"""A plugin logits processor that raises fails the requests that use it, and only those: the
real server, with a test-only distribution whose ``explode`` processor raises in ``apply``,
answers such a request with a 500 naming the processor and its error, while a request
running beside it in the same batches gets its 200 and the tokens it has alone; /health
stays 200 and later requests are served."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import (
    MODEL_NAME,
    ServerFactory,
    free_port,
    topology_args,
    write_plugin_distribution,
)

PLUGIN = '''"""``explode`` (a JSON boolean): the row's processor raises, as a buggy plugin would."""

from tandem.core.llm.logits_processor import LogitsProcessor


class Exploding(LogitsProcessor):
    extra_params = ("explode",)

    @classmethod
    def uses(cls, params):
        return params.extra.get("explode") is True

    def add(self, slot, row):
        pass

    def apply(self, logits, rows):
        raise RuntimeError("the plugin's own bug")
'''

ENTRY_POINTS = """[tandem.logits_processors]
explode = toy_exploding:Exploding
"""


def _complete(base_url: str, max_tokens: int, **extra: Any) -> httpx.Response:
    body = {
        "model": MODEL_NAME,
        "prompt": "hello world",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }
    return httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)


# Sampling runs on rank 0 alone: its failures must reach the engine as data, also from a
# worker process, and leave the other rank's collectives in step.
@pytest.mark.parametrize("topology", ["tp1", "tp2-single-process", "tp2-multi-process"])
def test_a_failing_plugin_processor_fails_its_request_alone(
    topology: str, tmp_path: Path, start_server: ServerFactory
) -> None:
    site = write_plugin_distribution(tmp_path, "toy_exploding", PLUGIN, ENTRY_POINTS)
    path = f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    [args], env = topology_args(topology, free_port())
    server = start_server(*args, env={"PYTHONPATH": path, **env})
    url = server.base_url
    alone = _complete(url, 128)
    assert alone.status_code == 200, alone.text

    with ThreadPoolExecutor(4) as pool:
        normal = pool.submit(_complete, url, 128)
        # Sent while the normal request decodes, so both share the failing steps.
        time.sleep(0.05)
        bad = [pool.submit(_complete, url, 8, explode=True) for _ in range(2)]
        answers = [f.result() for f in bad]
        ran_on = not normal.done()
        beside = normal.result()

    for answer in answers:
        assert answer.status_code == 500, answer.text
        message = answer.json()["error"]["message"]
        assert "the logits processor Exploding (toy_exploding) failed in apply" in message
        assert "RuntimeError: the plugin's own bug" in message
    assert beside.status_code == 200, beside.text
    # It ran on past the failures (it shared their steps).
    assert ran_on
    assert beside.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]

    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    again = _complete(url, 8, explode=False)
    assert again.status_code == 200, again.text
    # Every KV block is back, the failed requests' too.
    server.wait_idle()
