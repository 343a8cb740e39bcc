"""Structured outputs through the official openai client: random JSON schemas answered by a
random-weight model always validate, streamed or not and many schemas in one batch; json_object,
regex, choice and grammar (response_format, structured_outputs and the older guided_*)."""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import pytest
from harness import MODEL_NAME, Server, ServerFactory, openai_client
from openai import OpenAI

NUM_SCHEMAS = 50
# The demo model's context is 512 tokens; the schemas below need far fewer.
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def client(server: Server) -> OpenAI:
    return openai_client(server.base_url)


def _leaf(rng: random.Random) -> dict[str, Any]:
    # Every leaf is bounded: a random model fills whatever room a schema leaves it.
    kind = rng.choice(["integer", "string", "enum", "boolean", "int-enum", "null"])
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(2, 6)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cat", "dog", "λ", "多"], 3)}
    if kind == "int-enum":
        return {"enum": rng.sample(range(100), 3)}
    return {"type": kind}


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    roll = rng.random()
    if depth < 2 and roll < 0.25:
        return _object(rng, depth + 1)
    if depth < 2 and roll < 0.45:
        return {
            "type": "array",
            "items": _value(rng, depth + 1),
            "minItems": rng.randint(0, 1),
            "maxItems": rng.randint(1, 3),
        }
    return _leaf(rng)


def _object(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    names = rng.sample(["id", "name", "tags", "size", "owner", "kind", "meta", "ok"], 4 - depth)
    properties = {name: _value(rng, depth) for name in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": properties, "required": required}


def _schemas() -> list[dict[str, Any]]:
    rng = random.Random(20260)
    return [_object(rng) for _ in range(NUM_SCHEMAS)]


def _ask(client: OpenAI, schema: dict[str, Any], seed: int, stream: bool) -> str:
    kwargs: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": f"Give me a record ({seed})."}],
        "max_tokens": MAX_TOKENS,
        "temperature": 1.0,
        "seed": seed,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": f"record_{seed}", "schema": schema, "strict": True},
        },
    }
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "stop", choice
        return choice.message.content or ""
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize("stream", [False, True])
def test_random_schemas_all_validate(client: OpenAI, stream: bool) -> None:
    schemas = _schemas()
    # All in flight at once: the engine batches requests of different schemas together.
    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(lambda i: _ask(client, schemas[i], i, stream), range(NUM_SCHEMAS)))
    valid = 0
    for schema, text in zip(schemas, texts, strict=True):
        jsonschema.validate(json.loads(text), schema)
        valid += 1
    assert valid == NUM_SCHEMAS


def test_json_object_regex_choice_and_grammar(client: OpenAI) -> None:
    def complete(**extra: Any) -> str:
        return (
            client.completions.create(
                model=MODEL_NAME, prompt="hello", max_tokens=120, temperature=0, extra_body=extra
            )
            .choices[0]
            .text
        )

    assert isinstance(json.loads(complete(response_format={"type": "json_object"})), dict)
    assert isinstance(json.loads(complete(structured_outputs={"json_object": True})), dict)
    assert re.fullmatch(
        r"\d{3}-[a-z]{2,4}", complete(structured_outputs={"regex": r"\d{3}-[a-z]{2,4}"})
    )
    assert re.fullmatch(r"(yes|no)!", complete(guided_regex=r"(yes|no)!"))
    assert complete(structured_outputs={"choice": ["alpha", "beta"]}) in {"alpha", "beta"}
    assert complete(guided_choice=["one", "two", "three"]) in {"one", "two", "three"}
    # Bounded: a random model never chooses to stop a repetition by itself.
    grammar = 'start: "(" item ("," item)? ("," item)? ")"\nitem: /[0-9]/'
    assert re.fullmatch(r"\(\d(,\d){0,2}\)", complete(structured_outputs={"grammar": grammar}))
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert set(json.loads(complete(guided_json=schema))) == {"n"}


def test_a_schema_the_engine_cannot_compile_is_a_400(client: OpenAI) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "object", "minProperties": "x"}},
            },
        )
    assert info.value.status_code == 400
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == "response_format.json_schema.schema"


# Compiles in milliseconds, then needs more lexer work per token than llguidance allows one
# mask: on the old code every such request failed mid-stream (or passed, once others had
# warmed the cached lexer). Now it is a 400 before the first token, every time.
TOO_COMPLEX_REGEX = "([a-z]{1,5}){300,1000}"


def _refused(client: OpenAI, **extra: Any) -> dict[str, Any]:
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        stream = client.completions.create(
            model=MODEL_NAME, prompt="hi", max_tokens=50, stream=True, extra_body=extra
        )
        pytest.fail(f"answered with a stream: {[c.choices[0].text for c in stream]}")
    assert info.value.status_code == 400
    body = info.value.body
    assert isinstance(body, dict)
    return body


def test_a_regex_too_complex_for_the_lexer_is_a_400_before_any_token_every_time(
    client: OpenAI,
) -> None:
    first = _refused(client, structured_outputs={"regex": TOO_COMPLEX_REGEX})
    assert first["param"] == "structured_outputs.regex"
    assert "too complex" in first["message"], first
    # Again, now from the cache: the same answer.
    assert _refused(client, structured_outputs={"regex": TOO_COMPLEX_REGEX}) == first


def test_a_schema_nested_400_deep_is_a_400_naming_the_depth_limit(client: OpenAI) -> None:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(400):
        schema = {"allOf": [schema]}
    body = _refused(client, guided_json=schema)
    assert body["param"] == "guided_json" and "--max-schema-depth" in body["message"], body


def test_grammar_size_and_compile_time_budgets_are_400s(start_server: ServerFactory) -> None:
    server = start_server("--max-grammar-bytes", "2000", "--grammar-compile-timeout-s", "0.001")
    small = openai_client(server.base_url)
    body = _refused(small, guided_choice=["x" * 1000] * 3)
    assert "--max-grammar-bytes" in body["message"], body
    body = _refused(small, guided_regex="[a-z ]{100,200}")
    assert "--grammar-compile-timeout-s" in body["message"], body
