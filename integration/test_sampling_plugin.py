"""A new sampling parameter as a plugin, the worked example of ``docs/extending.md``: a
test-only distribution (written here, found through its ``entry_points.txt`` like any
installed package) declares a ``no_repeat`` logits processor, and the real server serves it
with nothing in Tandem naming it: the request field reaches the processor through
``SamplingParams.extra``, a bad value is a 400 naming the field, and the processor keeps its
own state per row (the last token each row sampled), told by the engine as rows come and go.
"""

from __future__ import annotations

import itertools
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from harness import MODEL_NAME, ServerFactory, openai_client
from openai import OpenAI

PLUGIN = '''"""``no_repeat`` (a JSON boolean): a row never samples the token it sampled last."""

import torch

from tandem.core.errors import InvalidRequestError
from tandem.core.llm.logits_processor import LogitsProcessor


class NoRepeat(LogitsProcessor):
    extra_params = ("no_repeat",)

    def __init__(self, ctx):
        super().__init__(ctx)
        # The token each slot sampled last (-1: none yet), on the device.
        self.last = torch.full((ctx.max_rows,), -1, dtype=torch.int64, device=ctx.device)

    @classmethod
    def uses(cls, params):
        return params.extra.get("no_repeat") is True

    @classmethod
    def validate(cls, params):
        value = params.extra.get("no_repeat", False)
        if not isinstance(value, bool):
            raise InvalidRequestError(
                f"no_repeat must be a boolean, got {value!r}", param="no_repeat"
            )

    @classmethod
    def needs_token_ids(cls, params):
        return True

    def add(self, slot, row):
        # A row resumed after a preemption has tokens already.
        out = row.output_token_ids
        self.last[slot] = int(out[-1]) if out.numel() else -1

    def apply(self, logits, rows):
        index = rows.rows_on(logits.device)
        last = self.last[rows.slots_on(logits.device)]
        column = last.clamp(min=0).unsqueeze(1)
        sub = logits[index]
        # A row without a token yet keeps its column as it was.
        kept = torch.where(last >= 0, float("-inf"), sub.gather(1, column).squeeze(1))
        logits[index] = sub.scatter(1, column, kept.unsqueeze(1))
        return logits

    def on_sampled(self, rows, tokens):
        device = tokens.device
        self.last[rows.slots_on(device)] = tokens[rows.rows_on(device)]
'''

ENTRY_POINTS = """[tandem.logits_processors]
no_repeat = toy_sampling:NoRepeat
"""

FORCED = 77


def _token_ids(client: OpenAI, **extra: Any) -> list[int]:
    out = client.completions.create(
        model=MODEL_NAME,
        prompt="hello world",
        max_tokens=8,
        temperature=0,
        logit_bias={str(FORCED): 100},
        logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True, **extra},
    )
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    return [int(token.removeprefix("token_id:")) for token in logprobs.tokens]


def test_a_sampling_parameter_plugs_in_through_an_entry_point(
    tmp_path: Path, start_server: ServerFactory
) -> None:
    site = tmp_path / "site"
    (site / "toy_sampling").mkdir(parents=True)
    (site / "toy_sampling" / "__init__.py").write_text(PLUGIN)
    info = site / "toy_sampling-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-sampling\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    path = f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    server = start_server(env={"PYTHONPATH": path})
    client = openai_client(server.base_url)

    # A bias of 100 makes every greedy token the forced one; no_repeat bans it every other
    # step. Both run in one batch: the plain row is not touched by the other's processor.
    with ThreadPoolExecutor(4) as pool:
        plain = [pool.submit(_token_ids, client) for _ in range(2)]
        toy = [pool.submit(_token_ids, client, no_repeat=True) for _ in range(2)]
        outputs = [f.result() for f in plain], [f.result() for f in toy]
    for tokens in outputs[0]:
        assert tokens == [FORCED] * 8
    for tokens in outputs[1]:
        assert tokens[0::2] == [FORCED] * 4, tokens
        assert FORCED not in tokens[1::2], tokens
        assert all(a != b for a, b in itertools.pairwise(tokens)), tokens
    assert _token_ids(client, no_repeat=False) == [FORCED] * 8

    bad = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "no_repeat": "yes"},
        timeout=30,
    )
    assert bad.status_code == 400, bad.text
    error = bad.json()["error"]
    assert error["param"] == "no_repeat" and "must be a boolean" in error["message"]
