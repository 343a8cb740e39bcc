"""vLLM's sampling extras and prompt logprobs through the official openai client, against the
real server process: each equals the engine run in-process, streamed or not, alone or in a
batch with other kinds of requests."""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import MODEL_NAME, Server, openai_client
from openai import OpenAI

from tandem.core import EngineConfig, LLMEngine, ModelLoadConfig, SamplingParams
from tandem.core.config import CacheConfig

PROMPT = "the model reads the prompt"

# (extra request fields, the same as SamplingParams fields)
CASES: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"presence_penalty": 1.5}, {"presence_penalty": 1.5}),
    ({"frequency_penalty": 1.2}, {"frequency_penalty": 1.2}),
    ({"repetition_penalty": 1.4}, {"repetition_penalty": 1.4}),
    (
        {"min_p": 0.1, "temperature": 1.0, "seed": 11},
        {"min_p": 0.1, "temperature": 1.0, "seed": 11},
    ),
    ({"logit_bias": {"77": 8.0, "78": -100}}, {"logit_bias": {77: 8.0, 78: -100.0}}),
    ({"min_tokens": 6, "logit_bias": {"2": 30}}, {"min_tokens": 6, "logit_bias": {2: 30.0}}),
]


@pytest.fixture(scope="module")
def client(server: Server) -> OpenAI:
    return openai_client(server.base_url)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[LLMEngine]:
    engine = LLMEngine(
        EngineConfig(model=ModelLoadConfig(model=str(model_dir)), cache=CacheConfig(num_blocks=256))
    )
    yield engine
    engine.shutdown()


# Fields the openai client takes as arguments; the others go in extra_body.
TYPED = ("temperature", "seed", "presence_penalty", "frequency_penalty", "logit_bias")


def _completion(client: OpenAI, extra: dict[str, Any], stream: bool = False) -> str:
    fields = {"temperature": 0, **extra}
    typed = {k: fields.pop(k) for k in TYPED if k in fields}
    kwargs: dict[str, Any] = {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": 14,
        **typed,
        "extra_body": fields,
    }
    if not stream:
        text: str = client.completions.create(**kwargs).choices[0].text
        return text
    return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))


@pytest.mark.parametrize(("extra", "params"), CASES, ids=[str(c[0]) for c in CASES])
def test_sampling_extras_equal_the_engine(
    client: OpenAI, engine: LLMEngine, extra: dict[str, Any], params: dict[str, Any]
) -> None:
    base = {"temperature": 0.0, "max_tokens": 14}
    expected = engine.generate([PROMPT], SamplingParams(**{**base, **params}))[0].text
    kept = {k: v for k, v in params.items() if k in ("temperature", "seed")}
    plain = engine.generate([PROMPT], SamplingParams(**{**base, **kept}))[0].text
    assert expected != plain, "the case must change the output"
    assert _completion(client, extra) == expected
    assert _completion(client, extra, stream=True) == expected


def test_a_mixed_batch_equals_each_request_alone(client: OpenAI) -> None:
    extras: list[dict[str, Any]] = [
        {},
        {"presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
        {"structured_outputs": {"regex": "[a-z]{2,5}( [a-z]{2,5}){2}"}},
        {"min_p": 0.2, "temperature": 0.9, "seed": 5},
        {"response_format": {"type": "json_object"}, "max_tokens": 60},
        {"logit_bias": {"30": 5}, "min_tokens": 3},
    ]
    extras = [{**e, "max_tokens": e.get("max_tokens", 14)} for e in extras]

    def run(extra: dict[str, Any]) -> str:
        extra = dict(extra)
        max_tokens = extra.pop("max_tokens")
        kwargs = {"temperature": 0, **extra}
        return (
            client.completions.create(
                model=MODEL_NAME,
                prompt=PROMPT,
                max_tokens=max_tokens,
                temperature=kwargs.pop("temperature"),
                seed=kwargs.pop("seed", None),
                extra_body=kwargs,
            )
            .choices[0]
            .text
        )

    alone = [run(e) for e in extras]
    with ThreadPoolExecutor(len(extras) * 2) as pool:
        together = list(pool.map(run, extras * 2))
    assert together == alone * 2


def test_echo_with_logprobs_returns_the_prompt_scored(client: OpenAI, engine: LLMEngine) -> None:
    ids = engine.tokenizer.encode(PROMPT)
    [reference] = engine.generate(
        [PROMPT], SamplingParams.greedy(max_tokens=4, logprobs=2, prompt_logprobs=2)
    )
    assert reference.prompt_logprobs is not None and reference.logprobs is not None
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=2
    )
    choice = response.choices[0]
    assert choice.text == PROMPT + reference.text
    assert choice.logprobs is not None
    values = choice.logprobs.token_logprobs
    assert values is not None and len(values) == len(ids) + 4
    assert values[0] is None and choice.logprobs.top_logprobs is not None
    assert choice.logprobs.top_logprobs[0] is None
    expected = [e.logprob for e in reference.prompt_logprobs[1:] if e is not None]
    expected += [e.logprob for e in reference.logprobs]
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(values[1:], expected, strict=True))
    # Streamed: the same numbers, the echo first.
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=4,
            temperature=0,
            echo=True,
            logprobs=2,
            stream=True,
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    streamed = [
        v
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for v in c.choices[0].logprobs.token_logprobs or []
    ]
    assert streamed == values
    # Scoring only (max_tokens 0), what evaluation harnesses send.
    scored = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0
    )
    assert scored.choices[0].text == PROMPT
    assert scored.choices[0].logprobs is not None
    assert scored.choices[0].logprobs.token_logprobs == values[: len(ids)]
    assert scored.usage is not None and scored.usage.completion_tokens == 0


def test_prompt_logprobs_extra(client: OpenAI, engine: LLMEngine) -> None:
    ids = engine.tokenizer.encode(PROMPT)
    response = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=2,
        temperature=0,
        extra_body={"prompt_logprobs": 1},
    )
    scored = response.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    assert len(scored) == len(ids) and scored[0] is None
    for token, entry in zip(ids[1:], scored[1:], strict=True):
        assert str(token) in entry
        assert {"logprob", "rank", "decoded_token"} <= set(entry[str(token)])
        assert sorted(e["rank"] for e in entry.values())[0] == 1
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"prompt_logprobs": 0},
    )
    assert chat.model_extra is not None and chat.model_extra["prompt_logprobs"][0] is None


def test_tokens_as_token_ids(client: OpenAI) -> None:
    response = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        logprobs=0,
        extra_body={"return_tokens_as_token_ids": True},
    )
    logprobs = response.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert all(t.startswith("token_id:") and t[9:].isdigit() for t in logprobs.tokens)


def test_include_stop_str_in_output(client: OpenAI) -> None:
    text = _completion(client, {})
    stop = text[4:7]
    kept = _completion(client, {"stop": [stop], "include_stop_str_in_output": True})
    assert kept == text[: text.index(stop) + len(stop)]


def test_tokenize_and_detokenize(server: Server, engine: LLMEngine) -> None:
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        plain = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": PROMPT}).json()
        assert plain["tokens"] == engine.tokenizer.encode(PROMPT)
        assert plain["count"] == len(plain["tokens"]) and plain["token_strs"] is None
        assert plain["max_model_len"] == engine.max_model_len
        messages = [{"role": "user", "content": "hi"}]
        chat = http.post("/tokenize", json={"messages": messages, "return_token_strs": True})
        rendered = engine.tokenizer.apply_chat_template(messages)
        assert chat.json()["tokens"] == engine.tokenizer.encode(rendered, add_special_tokens=False)
        assert len(chat.json()["token_strs"]) == chat.json()["count"]
        back = http.post("/detokenize", json={"tokens": plain["tokens"]}).json()
        assert back["prompt"] == PROMPT
