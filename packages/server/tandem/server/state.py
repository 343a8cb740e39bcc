"""Everything a request handler needs, built once at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.core import AsyncEngine, EngineLoop, LLMEngine
from tandem.server.metrics import ServerMetrics


@dataclass
class ServerState:
    loop: EngineLoop
    served_model_name: str
    metrics: ServerMetrics
    api_key: str | None = None
    max_body_bytes: int = 8 << 20

    @property
    def engine(self) -> LLMEngine:
        return self.loop.engine

    @property
    def async_engine(self) -> AsyncEngine:
        return AsyncEngine(self.loop)  # a stateless view; cheap to make per request
