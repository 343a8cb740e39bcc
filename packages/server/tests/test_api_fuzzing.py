"""API fuzzing with schemathesis: requests generated from the server's own OpenAPI schema,
valid and invalid, against the real app over a real engine (a one-layer model, short
context). Every route must answer without a 5xx, with a status the schema lists and a body
that matches the schema given for it (OpenAI-shaped errors included)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import BaseSchema, Case, GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tandem.core import CacheConfig, EngineConfig, EngineLoop, LLMEngine, ModelLoadConfig
from tandem.core.config import PipelineConfig
from tandem.core.demo.demo_model import tiny_spec, write_demo_model
from tandem.core.demo.rec_demo_model import tiny_rec_spec, write_rec_demo_model
from tandem.core.rec.service import RecService
from tandem.server.app import create_app
from tandem.server.metrics import ServerMetrics
from tandem.server.rec_app import RecMetrics, RecServerState, create_rec_app
from tandem.server.state import ServerState

SPEC = replace(tiny_spec(), num_layers=1, vocab_size=300, max_position_embeddings=48)
# Bounded examples per route: enough to reach every field's edges, short enough for CI.
# Derandomized: the same examples every run, so CI never depends on the draw.
FUZZ = settings(
    max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
)


@pytest.fixture(scope="module")
def llm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("m"), SPEC)


@pytest.fixture(scope="module")
def rec_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_rec_demo_model(tmp_path_factory.mktemp("rec"), tiny_rec_spec())


# An app per test: the schemathesis plugin ends an app's lifespan (which stops its engine)
# with the test that started it.
@pytest.fixture
def llm_app(llm_model: Path) -> Iterator[FastAPI]:
    folder = llm_model
    engine = LLMEngine(
        EngineConfig(model=ModelLoadConfig(model=str(folder)), cache=CacheConfig(num_blocks=64))
    )
    metrics = ServerMetrics(engine, "m")
    loop = EngineLoop(engine, on_finished=metrics.observe_finished)
    yield create_app(ServerState(loop=loop, served_model_name="m", metrics=metrics))
    loop.stop()


@pytest.fixture
def rec_app(rec_model: Path) -> Iterator[FastAPI]:
    folder = rec_model
    service = RecService(
        EngineConfig(
            model=ModelLoadConfig(model=str(folder)),
            cache=CacheConfig(num_blocks=256),
            pipeline=PipelineConfig(max_concurrency=2),
        )
    )
    state = RecServerState(service=service, served_model_name="r", metrics=RecMetrics(service, "r"))
    yield create_rec_app(state)
    service.shutdown()


@pytest.fixture
def llm_schema(llm_app: FastAPI) -> BaseSchema:
    return schemathesis.openapi.from_asgi("/openapi.json", llm_app)


@pytest.fixture
def rec_schema(rec_app: FastAPI) -> BaseSchema:
    return schemathesis.openapi.from_asgi("/openapi.json", rec_app)


LLM_ROUTES = [
    ("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"),
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
    ("POST", "/tokenize"), ("POST", "/detokenize"),
]  # fmt: skip
REC_ROUTES = [("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"),
              ("POST", "/v1/recommendations")]  # fmt: skip
MODES = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
# Not checked: that every schema-valid request gets a 2xx. Valid JSON may still be refused
# for what a schema cannot say (an unknown model name: 404; token ids outside this model's
# vocabulary, a prompt over its context: 400) and those answers are checked like any other.


def _fuzz(
    schema: BaseSchema, method: str, path: str, mode: GenerationMode, served: str
) -> Counter[int]:
    """Generated requests (``mode``: fitting the schema, or not) against one route; every
    answer is checked against the schema (no 5xx, listed status, matching body). Half of
    the valid bodies name the served model, so they reach the engine instead of a 404. Returns
    how often each status was answered."""
    operation = schema[path][method]
    strategy = operation.as_strategy(generation_mode=mode)
    if method == "POST" and mode is GenerationMode.POSITIVE:
        # (Not for invalid bodies: naming the model could make one valid.)
        strategy = st.one_of(strategy, strategy.map(partial(_naming, served, path)))
    statuses: Counter[int] = Counter()

    @FUZZ
    @given(case=strategy)
    def run(case: Case[Any]) -> None:
        response = case.call_and_validate(excluded_checks=[positive_data_acceptance])
        statuses[response.status_code] += 1

    run()
    # Every route is fuzzed on a running engine: never the 503 of a stopped one.
    assert not statuses[503], f"the engine stopped under the fuzzing: {statuses}"
    return statuses


def _naming(model: str, path: str, case: Case[Any]) -> Case[Any]:
    if isinstance(case.body, dict):
        case.body["model"] = model
        # Random messages rarely pass the chat checks (roles, contents, tool call ids).
        if "messages" in case.body:
            case.body["messages"] = [{"role": "user", "content": "hello"}]
        if path == "/tokenize":
            # Exactly one of prompt and messages, which the schema cannot say: otherwise
            # whether any generated body reaches the tokenizer depends on the draw (with
            # both or neither, all 40 were 400s in some suite orders).
            if "prompt" in case.body:
                case.body.pop("messages", None)
            elif "messages" not in case.body:
                case.body["prompt"] = "hello"
    return case


def _cases(routes: list[tuple[str, str]]) -> list[tuple[str, str, GenerationMode]]:
    """Every route with valid inputs, and those that take a body with invalid ones too
    (routes without inputs have no invalid request to make)."""
    return [
        (method, path, mode)
        for method, path in routes
        for mode in MODES
        if method == "POST" or mode is GenerationMode.POSITIVE
    ]


@pytest.mark.parametrize(("method", "path", "mode"), _cases(LLM_ROUTES), ids=str)
def test_llm_routes_answer_as_their_schema_says(
    llm_schema: BaseSchema, method: str, path: str, mode: GenerationMode
) -> None:
    statuses = _fuzz(llm_schema, method, path, mode, served="m")
    if method == "POST" and mode is GenerationMode.POSITIVE:
        assert statuses[200] > 0, f"no generated request reached the engine: {statuses}"


@pytest.mark.parametrize(("method", "path", "mode"), _cases(REC_ROUTES), ids=str)
def test_recommender_routes_answer_as_their_schema_says(
    rec_schema: BaseSchema, method: str, path: str, mode: GenerationMode
) -> None:
    statuses = _fuzz(rec_schema, method, path, mode, served="r")
    if method == "POST" and mode is GenerationMode.POSITIVE:
        assert statuses[200] > 0, f"no generated request reached the engine: {statuses}"


def test_every_route_is_described_with_its_errors(llm_app: FastAPI, tmp_path: Path) -> None:
    schema = llm_app.openapi()
    paths = schema["paths"]
    assert set(paths) == {"/health", "/metrics", "/v1/models", "/v1/completions",
                          "/v1/chat/completions", "/tokenize", "/detokenize"}  # fmt: skip
    for route in ("/v1/completions", "/v1/chat/completions"):
        responses = paths[route]["post"]["responses"]
        assert {"200", "400", "404", "413", "500", "503"} <= set(responses)
        assert "422" not in responses
        error = responses["400"]["content"]["application/json"]["schema"]["$ref"]
        assert error.endswith("/ErrorResponse")
    (tmp_path / "openapi.json").write_text(json.dumps(schema))
