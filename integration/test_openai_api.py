"""The OpenAI API through the official ``openai`` client, against the real server process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import MODEL_NAME, Server, openai_client
from openai import OpenAI

from tandem.core import EngineConfig, LLMEngine, ModelLoadConfig, SamplingParams
from tandem.core.config import CacheConfig

PROMPTS = ["hello world", "the model reads the prompt", "Question: what is 4 + 5?"]


@pytest.fixture(scope="module")
def client(server: Server) -> OpenAI:
    return openai_client(server.base_url)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Any:
    engine = LLMEngine(
        EngineConfig(model=ModelLoadConfig(model=str(model_dir)), cache=CacheConfig(num_blocks=256))
    )
    yield engine
    engine.shutdown()


def test_models(client: OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]


def test_greedy_completions_equal_the_engine(client: OpenAI, engine: LLMEngine) -> None:
    expected = engine.generate(PROMPTS, SamplingParams.greedy(max_tokens=12, ignore_eos=True))
    response = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    choices = sorted(response.choices, key=lambda c: c.index)
    assert [c.text for c in choices] == [o.text for o in expected]
    assert all(c.finish_reason == "length" for c in choices)
    assert response.usage is not None
    assert response.usage.completion_tokens == 36
    assert response.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)


def test_streamed_completion_equals_the_plain_one(client: OpenAI) -> None:
    plain = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=16, temperature=0
    )
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[1],
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert plain.usage is not None
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens == 16


def test_token_id_prompt_and_echo(client: OpenAI, engine: LLMEngine) -> None:
    ids = engine.tokenizer.encode("hello world")
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=5, temperature=0)
    by_text = client.completions.create(
        model=MODEL_NAME, prompt="hello world", max_tokens=5, temperature=0, echo=True
    )
    assert by_text.choices[0].text == "hello world" + by_ids.choices[0].text


def test_chat_plain_and_streamed_equal_the_engine(client: OpenAI, engine: LLMEngine) -> None:
    messages: list[Any] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What does the scheduler do?"},
    ]
    rendered = engine.tokenizer.apply_chat_template(messages)
    prompt_ids = engine.tokenizer.encode(rendered, add_special_tokens=False)
    [expected] = engine.generate([prompt_ids], SamplingParams.greedy(max_tokens=10))
    plain = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_completion_tokens=10, temperature=0
    )
    assert plain.choices[0].message.role == "assistant"
    assert plain.choices[0].message.content == expected.text
    assert plain.choices[0].finish_reason == expected.finish_reason
    assert plain.usage is not None and plain.usage.prompt_tokens == len(prompt_ids)
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == expected.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == expected.finish_reason and all(f is None for f in finals[:-1])
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_chat_template_kwargs_reach_the_template(client: OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert response.choices[0].finish_reason in ("stop", "length")


def test_stop_string_across_stream_chunks(client: OpenAI, engine: LLMEngine) -> None:
    [free] = engine.generate([PROMPTS[0]], SamplingParams.greedy(max_tokens=16, ignore_eos=True))
    # A stop string straddling the boundary between the 3rd and 4th streamed tokens.
    boundary = len(engine.tokenizer.decode(free.token_ids[:3]))
    stop = free.text[boundary - 2 : boundary + 2]
    assert len(stop) == 4
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[0],
        max_tokens=16,
        temperature=0,
        stop=[stop],
        stream=True,
        extra_body={"ignore_eos": True},
    )
    pieces = [c.choices[0].text for c in stream if c.choices]
    text = "".join(pieces)
    assert text == free.text[: free.text.index(stop)]
    assert stop not in text


def test_logprobs(client: OpenAI) -> None:
    completion = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=3
    )
    lp = completion.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert lp.token_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == 4
    for token, top in zip(lp.tokens, lp.top_logprobs, strict=True):
        assert token in top and len(top) >= 3
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs
    assert content is not None and content.content is not None
    for entry in content.content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)


def test_n_choices_and_seed(client: OpenAI) -> None:
    def sample() -> list[str]:
        response = client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPTS[2],
            max_tokens=8,
            temperature=1.0,
            n=3,
            seed=11,
            extra_body={"ignore_eos": True},
        )
        return [c.text for c in sorted(response.choices, key=lambda c: c.index)]

    first = sample()
    assert len(first) == 3 and len(set(first)) > 1
    assert sample() == first
