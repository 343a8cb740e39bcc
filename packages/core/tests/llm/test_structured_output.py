"""Structured outputs through the engine: the output follows its grammar, whatever shares the
batch; compilation is cached and failures name the request field."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from tandem.core import InvalidRequestError, LLMEngine, SamplingParams
from tandem.core.llm.structured_output import close_objects
from tandem.core.llm.structured_output_spec import StructuredOutputSpec

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
}


def test_json_regex_and_choice_in_one_batch(
    demo_dir: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    engine = make_engine(demo_dir, max_tokens_per_batch=32)
    specs = {
        "json": StructuredOutputSpec.json_schema(SCHEMA, "response_format"),
        "regex": StructuredOutputSpec.regex(r"[a-z]{3,6}-[0-9]{2}", "structured_outputs"),
        "choice": StructuredOutputSpec.choice(["yes", "no", "maybe"], "structured_outputs"),
    }
    params = [
        SamplingParams(max_tokens=80, temperature=1.0, seed=3, structured_output=specs["json"]),
        SamplingParams.greedy(max_tokens=80, structured_output=specs["regex"]),
        SamplingParams(max_tokens=12, temperature=1.0, structured_output=specs["choice"]),
        SamplingParams.greedy(max_tokens=10, ignore_eos=True),
    ]
    prompts = ["hello world", "the model reads", "Question: what is 4 + 5?", "λ"]
    together = engine.generate(prompts, params)
    jsonschema.validate(json.loads(together[0].text), SCHEMA)
    assert re.fullmatch(r"[a-z]{3,6}-[0-9]{2}", together[1].text), together[1].text
    assert together[2].text in {"yes", "no", "maybe"}
    assert len(together[3].token_ids) == 10
    assert all(o.finish_reason in ("stop", "length") for o in together)
    assert [o.finish_reason for o in together[:3]] == ["stop"] * 3
    # Grammar rows are as batch-independent as any other: alone, the same tokens.
    for prompt, p, out in zip(prompts, params, together, strict=True):
        if p.seed is not None or p.is_greedy:
            assert engine.generate([prompt], p)[0].token_ids == out.token_ids


def test_compiled_grammars_are_cached(
    demo_dir: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    compiler = make_engine(demo_dir).structured_outputs
    first = compiler.submit(StructuredOutputSpec.json_schema(SCHEMA, "response_format"))
    # Equal specs from another field share the compiled grammar.
    again = compiler.submit(StructuredOutputSpec.json_schema(dict(SCHEMA), "structured_outputs"))
    assert again is first
    assert first.result() is again.result()


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputSpec.regex("a(b", "structured_outputs"),
        StructuredOutputSpec.json_schema({"type": "no-such-type"}, "response_format"),
        StructuredOutputSpec("json", "{not json", "response_format"),
        StructuredOutputSpec.grammar("start: undefined_rule", "structured_outputs"),
    ],
)
def test_bad_grammars_are_refused(
    demo_dir: Path, make_engine: Callable[..., LLMEngine], spec: StructuredOutputSpec
) -> None:
    engine = make_engine(demo_dir)
    with pytest.raises(InvalidRequestError) as info:
        engine.structured_outputs.submit(spec).result()
    assert info.value.param == spec.param
    with pytest.raises(InvalidRequestError):
        engine.add_request(None, "hi", SamplingParams(structured_output=spec))
    assert not engine.has_unfinished()


def test_close_objects_fills_in_additional_properties() -> None:
    schema = {
        "type": "object",
        "properties": {"inner": {"type": "object", "properties": {"x": {"type": "integer"}}}},
        "$defs": {"item": {"type": "object", "properties": {}}},
        "anyOf": [{"type": "object", "properties": {}, "additionalProperties": True}],
    }
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["inner"]["additionalProperties"] is False
    assert closed["$defs"]["item"]["additionalProperties"] is False
    assert closed["anyOf"][0]["additionalProperties"] is True
    assert "additionalProperties" not in schema
