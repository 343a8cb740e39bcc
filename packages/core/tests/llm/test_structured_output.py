"""Structured outputs through the engine: the output follows its grammar, whatever shares the
batch; compilation is cached and failures name the request field."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tandem.core import InvalidRequestError, LLMEngine, SamplingParams
from tandem.core.config import StructuredOutputConfig
from tandem.core.llm.structured_output import StructuredOutputs, close_objects
from tandem.core.llm.structured_output_spec import StructuredOutputSpec, json_depth

from ..conftest import engine_config

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


# Compiles in a few milliseconds, then needs more lexer work at each token than llguidance
# allows one mask (every split of the letters so far into runs of 1-5 stays live): on the
# old code, requests failed mid-output, or passed once earlier ones had warmed the lexer.
TOO_COMPLEX = StructuredOutputSpec.regex("([a-z]{1,5}){300,1000}", "structured_outputs.regex")


def _compiler(engine: LLMEngine, **budgets: Any) -> StructuredOutputs:
    return StructuredOutputs(
        engine.tokenizer,
        engine.model_config.vocab_size,
        engine.inputs.eos_token_ids,
        StructuredOutputConfig(cache_size=1, **budgets),
    )


def _refusal(compiler: StructuredOutputs, spec: StructuredOutputSpec) -> str:
    with pytest.raises(InvalidRequestError) as info:
        compiler.new_grammar(spec)
    assert info.value.param == spec.param
    return str(info.value)


def test_a_grammar_too_complex_for_the_lexer_is_refused_before_it_starts_every_time(
    demo_dir: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    engine = make_engine(demo_dir)
    compiler = _compiler(engine)
    try:
        first = _refusal(compiler, TOO_COMPLEX)
        assert "too complex" in first and "too many expressions" in first, first
        # Cached, and again after the cache (one entry) has dropped it: the same refusal.
        assert _refusal(compiler, TOO_COMPLEX) == first
        compiler.new_grammar(StructuredOutputSpec.regex("[a-z]{3}", "structured_outputs"))
        assert _refusal(compiler, TOO_COMPLEX) == first
        # Through the engine, the request is refused before it is queued.
        with pytest.raises(InvalidRequestError):
            engine.add_request(None, "hi", SamplingParams(structured_output=TOO_COMPLEX))
        assert not engine.has_unfinished()
    finally:
        compiler.shutdown()


def test_a_refusal_raised_again_keeps_no_frames(
    demo_dir: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    compiler = _compiler(make_engine(demo_dir))
    spec = StructuredOutputSpec.regex("a(b", "structured_outputs")
    try:
        for _ in range(3):
            _refusal(compiler, spec)
        # On the old code, each raise added the raiser's frames to the cached error.
        cached = compiler.submit(spec).exception()
        assert cached is not None and cached.__traceback__ is None
    finally:
        compiler.shutdown()


def test_a_deeply_nested_schema_is_refused_naming_the_depth_limit(
    demo_dir: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    engine = make_engine(demo_dir)
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(400):
        schema = {"allOf": [schema]}
    spec = StructuredOutputSpec.json_schema(schema, "response_format")
    message = _refusal(engine.structured_outputs, spec)
    assert "801 deep" in message and "--max-schema-depth" in message, message
    # Up to the limit, a nested schema compiles.
    schema = {"type": "integer"}
    for _ in range(31):
        schema = {"allOf": [schema]}
    assert json_depth(json.dumps(schema)) == 63
    engine.structured_outputs.new_grammar(StructuredOutputSpec.json_schema(schema, "x"))


def test_a_grammar_larger_than_the_size_limit_is_refused(
    demo_dir: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    compiler = _compiler(make_engine(demo_dir), max_grammar_bytes=1000)
    try:
        message = _refusal(compiler, StructuredOutputSpec.choice(["x" * 500] * 3, "choice"))
        assert "--max-grammar-bytes" in message and "1000" in message, message
        compiler.new_grammar(StructuredOutputSpec.choice(["x" * 400] * 2, "choice"))
    finally:
        compiler.shutdown()


def test_a_grammar_slower_to_compile_than_the_limit_is_refused(
    demo_dir: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    # The probe alone takes longer than 1 ms here.
    compiler = _compiler(make_engine(demo_dir), compile_timeout_s=0.001)
    try:
        message = _refusal(compiler, StructuredOutputSpec.regex("[a-z ]{100,200}", "regex"))
        assert "--grammar-compile-timeout-s" in message, message
    finally:
        compiler.shutdown()


def test_json_depth_counts_brackets_outside_strings() -> None:
    assert json_depth("3") == 0
    assert json_depth('{"a": "[[{{", "b": [1, {"c": []}]}') == 4
    assert json_depth("[" * 100_000 + "]" * 100_000) == 100_000


# 3,000 options after a prefix: llguidance's parser row outgrows max_items_in_row (2000)
# once it computes what may follow; a grammar the probe lets through stands for one whose
# limit is met past the probe's walk.
WIDE = StructuredOutputSpec.grammar(
    'start: "Once " pick\npick: ' + " | ".join(f'"w{i}"' for i in range(3000)) + "\n",
    "structured_outputs.grammar",
)


def test_a_choice_list_longer_than_a_parser_row_is_refused_naming_the_limit(
    demo_dir: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    engine = make_engine(demo_dir)
    spec = StructuredOutputSpec.choice([f"option {i}" for i in range(20_000)], "choice")
    message = _refusal(_compiler(engine, probe_tokens=0), spec)
    assert "20000 options" in message and "at most 1999 options" in message, message


def test_a_grammar_past_the_engines_limits_mid_output_is_the_clients_failure(
    demo_dir: Path,
) -> None:
    """Not refused up front (no probe here), the grammar breaks llguidance's row limit while
    the engine computes its mask: the request ends with an error naming the field, marked as
    the client's input (error_param), so the server answers 4xx, not 5xx."""
    config = replace(
        engine_config(demo_dir), structured_output=StructuredOutputConfig(probe_tokens=0)
    )
    engine = LLMEngine(config)
    try:
        out = engine.generate(["hi"], SamplingParams(max_tokens=16, structured_output=WIDE))[0]
    finally:
        engine.shutdown()
    assert out.finish_reason == "error"
    assert out.error_param == "structured_outputs.grammar"
    assert out.error is not None and "max is 2000" in out.error, out.error
    assert "grammar engine's limits" in out.error, out.error


def test_a_token_the_grammar_refuses_stays_the_servers_failure(
    demo_dir: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    """A sound grammar refusing a token means the bitmask failed to keep it out: not the
    client's input."""
    engine = make_engine(demo_dir)
    grammar = engine.structured_outputs.new_grammar(
        StructuredOutputSpec.regex("abc", "structured_outputs.regex")
    )
    refused = next(t for t in range(engine.model_config.vocab_size) if not grammar.accept(t))
    assert refused >= 0 and not grammar.broken


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="per-thread niceness is Linux's")
def test_grammars_compile_on_threads_nicer_than_the_server(
    demo_dir: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    """A burst of compiles must yield the cores to the event loop and the engine."""
    compiler = _compiler(make_engine(demo_dir), compile_niceness=7)
    before = {thread.ident for thread in threading.enumerate()}
    compiler.submit(StructuredOutputSpec.regex("[a-z]{3}", "structured_outputs.regex")).result()

    def niceness(task: Path) -> int:
        # Field 19 of stat, counted after the parenthesised name (which may hold spaces).
        return int((task / "stat").read_text().rsplit(")", 1)[1].split()[16])

    grammar = [
        Path(f"/proc/self/task/{thread.native_id}")
        for thread in threading.enumerate()
        if thread.name.startswith("tandem-grammar") and thread.ident not in before
    ]
    mine = Path(f"/proc/self/task/{threading.get_native_id()}")
    assert grammar and {niceness(t) for t in grammar} == {niceness(mine) + 7}
