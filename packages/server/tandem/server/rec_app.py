"""The HTTP API of a generative recommender, in the server's style: ``POST /v1/recommendations``
(the user's history as semantic-id tuples, ``num_candidates``) answers ranked candidate tuples
with scores; ``/v1/models``, ``/health`` and ``/metrics`` as for LLMs; OpenAI-shaped errors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr

from tandem.core.rec.request import RecResult
from tandem.core.rec.service import RecService
from tandem.device.sync import Promise
from tandem.server.app import add_health_and_metrics, add_limits
from tandem.server.common import check_model, new_id, now
from tandem.server.errors import install_error_handlers

T = TypeVar("T")


class RecommendationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    # Oldest first: each item is one semantic id per codebook level.
    history: list[list[StrictInt]]
    num_candidates: StrictInt = 10


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

    app = FastAPI(title="Tandem", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)

    add_health_and_metrics(app, service.check_health, state.metrics.render)

    @app.get("/v1/models")
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

    @app.post("/v1/recommendations")
    async def recommend(body: RecommendationRequest) -> dict[str, Any]:
        check_model(state.served_model_name, body.model)
        start = time.perf_counter()
        name = state.metrics.model_name
        try:
            promise = service.submit(body.history, body.num_candidates, new_id("rec"))
            result = await _await(promise)
        except Exception:
            state.metrics.requests.labels(name, "error").inc()
            raise
        state.metrics.requests.labels(name, "ok").inc()
        state.metrics.latency.labels(name).observe(time.perf_counter() - start)
        return _response(result, state.served_model_name, len(body.history))

    add_limits(app, state.max_body_bytes, state.api_key)
    return app
