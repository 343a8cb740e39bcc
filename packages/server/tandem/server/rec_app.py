"""The HTTP API of a generative recommender, in the server's style: ``POST /v1/recommendations``
(the user's history as semantic-id tuples, ``num_candidates``) answers ranked candidate tuples
with scores; ``/v1/models``, ``/health`` and ``/metrics`` as for LLMs; OpenAI-shaped errors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, create_model

from tandem.core.errors import EngineDeadError
from tandem.core.failure_text import client_text
from tandem.core.llm.sampling_params import MAX_INT
from tandem.core.models.rec_config import RecModelConfig
from tandem.core.rec.request import MAX_CANDIDATES, RecResult
from tandem.core.rec.service import RecService
from tandem.device.sync import Promise
from tandem.server.app import add_health_and_metrics, add_limits, new_app
from tandem.server.common import check_model, new_id, now
from tandem.server.deadline import request_deadline
from tandem.server.errors import ApiError
from tandem.server.openapi import MODELS_RESPONSES, RecommendationResponse, post_responses
from tandem.server.protocol import StrictInt, StrictStr
from tandem.server.state import ServerLimits

T = TypeVar("T")


class RecommendationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    # Oldest first: each item is one semantic id per codebook level.
    history: list[list[Annotated[StrictInt, Field(ge=0, le=MAX_INT)]]]
    num_candidates: StrictInt = Field(default=10, ge=1, le=MAX_CANDIDATES)


def request_model_for(model: RecModelConfig) -> type[RecommendationRequest]:
    """The request body as this model reads it (items of ``num_codebooks`` ids below
    ``codebook_size``, at most ``max_history`` of them), so the published schema says so."""
    code = Annotated[StrictInt, Field(ge=0, lt=model.codebook_size)]
    item = Annotated[list[code], Field(min_length=model.num_codebooks,
                                       max_length=model.num_codebooks)]  # fmt: skip
    history = Annotated[list[item], Field(min_length=1, max_length=model.max_history)]
    made: type[RecommendationRequest] = create_model(
        "RecommendationRequest", __base__=RecommendationRequest, history=(history, ...)
    )
    return made


class RecMetrics:
    def __init__(self, service: RecService, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.requests = Counter(
            "tandem:rec_requests", "Recommendation requests by outcome.", [*labels, "outcome"],
            registry=self.registry,
        )  # fmt: skip
        self.latency = Histogram(
            "tandem:rec_request_latency_seconds", "Time from arrival to candidates.", labels,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=self.registry,
        )  # fmt: skip
        waiting = Gauge("tandem:num_requests_waiting", "Requests waiting for blocks or a lane.",
                        labels, registry=self.registry)  # fmt: skip
        in_flight = Gauge("tandem:rec_batches_in_flight", "Batches on pipeline lanes.", labels,
                          registry=self.registry)  # fmt: skip
        usage = Gauge("tandem:kv_cache_usage_perc", "Fraction of KV blocks reserved.", labels,
                      registry=self.registry)  # fmt: skip
        waiting.labels(model_name).set_function(lambda: service.stats().num_waiting)
        in_flight.labels(model_name).set_function(lambda: service.stats().num_batches_in_flight)
        usage.labels(model_name).set_function(lambda: service.stats().kv_cache_usage)
        self.model_name = model_name

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass
class RecServerState:
    service: RecService
    served_model_name: str
    metrics: RecMetrics
    api_key: str | None = None
    max_body_bytes: int = 8 << 20
    limits: ServerLimits = field(default_factory=ServerLimits)


async def _await(promise: Promise[T]) -> T:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(done: Promise[T]) -> None:
        def apply() -> None:
            if future.done():
                return
            error = done.exception()
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(done.result())

        loop.call_soon_threadsafe(apply)

    promise.add_done_callback(settle)
    return await future


def _response(result: RecResult, model: str, history_len: int) -> dict[str, Any]:
    return {
        "id": result.request_id,
        "object": "recommendation",
        "created": now(),
        "model": model,
        "candidates": [
            {"item": list(item), "score": score}
            for item, score in zip(result.candidates, result.scores, strict=True)
        ],
        "usage": {"history_items": history_len, "candidates": len(result.candidates)},
    }


def create_rec_app(state: RecServerState) -> FastAPI:
    service = state.service

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        service.shutdown()

    app = new_app(lifespan)
    add_health_and_metrics(app, service.check_health, state.metrics.render)

    @app.get("/v1/models", responses=MODELS_RESPONSES)
    async def models() -> dict[str, Any]:
        mc = service.model_config
        card = {
            "id": state.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "tandem",
            "root": service.config.model.model,
            "kind": "generative-recommender",
            "num_codebooks": mc.num_codebooks,
            "codebook_size": mc.codebook_size,
            "max_history": mc.max_history,
        }
        return {"object": "list", "data": [card]}

    async def recommend(body: RecommendationRequest) -> dict[str, Any]:
        check_model(state.served_model_name, body.model)
        start = time.perf_counter()
        name = state.metrics.model_name
        limit = state.limits.request_timeout_s
        try:
            promise = service.submit(body.history, body.num_candidates, new_id("rec"))
            # A batch runs its rounds to the end; past the limit (counted from the
            # request's arrival) its result is dropped.
            deadline = request_deadline()
            left = None if deadline is None else deadline - asyncio.get_running_loop().time()
            result = await asyncio.wait_for(_await(promise), limit if left is None else left)
        except EngineDeadError as exc:
            # Queued, then the engine failed under it (one that failed before answers 503).
            state.metrics.requests.labels(name, "error").inc()
            raise ApiError(500, f"Recommendation failed: {client_text(str(exc))}") from None
        except asyncio.TimeoutError:
            state.metrics.requests.labels(name, "timeout").inc()
            raise ApiError(
                504,
                f"The request ran longer than this server's limit of {limit:g} s "
                "(--request-timeout-s) and was stopped.",
                code="timeout",
            ) from None
        except Exception:
            state.metrics.requests.labels(name, "error").inc()
            raise
        state.metrics.requests.labels(name, "ok").inc()
        state.metrics.latency.labels(name).observe(time.perf_counter() - start)
        return _response(result, state.served_model_name, len(body.history))

    # Validated (and published) as this model reads it.
    recommend.__annotations__["body"] = request_model_for(service.model_config)
    app.post(
        "/v1/recommendations",
        responses=post_responses(RecommendationResponse, streams=False),
    )(recommend)

    add_limits(app, state.max_body_bytes, state.api_key, state.limits)
    return app
