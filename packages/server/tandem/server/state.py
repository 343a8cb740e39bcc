"""Everything a request handler needs, built once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.core import AsyncEngine, EngineLoop, LLMEngine
from tandem.server.metrics import ServerMetrics


@dataclass(frozen=True)
class ChatConfig:
    """How chat requests are rendered and their outputs read: the server's flags."""

    # The template text of --chat-template; None: the model's own.
    chat_template: str | None = None
    # --tool-call-parser / --reasoning-parser names (tool_parsers/, reasoning/).
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


@dataclass
class ServerState:
    loop: EngineLoop
    served_model_name: str
    metrics: ServerMetrics
    api_key: str | None = None
    max_body_bytes: int = 8 << 20
    # Further names clients may send (vLLM's --served-model-name A B ...).
    model_aliases: tuple[str, ...] = ()
    chat: ChatConfig = field(default_factory=ChatConfig)

    @property
    def engine(self) -> LLMEngine:
        return self.loop.engine

    @property
    def async_engine(self) -> AsyncEngine:
        return AsyncEngine(self.loop)  # a stateless view; cheap to make per request
