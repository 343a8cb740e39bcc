"""Everything a request handler needs, built once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.core import AsyncEngine, EngineLoop, LLMEngine
from tandem.server.metrics import ServerMetrics
from tandem.server.preparer import RequestPreparer


@dataclass(frozen=True)
class ServerLimits:
    """What bounds one request's time and what it may bring, besides the body size."""

    # Wall-clock seconds a request may take from arrival to its last byte (None: no limit);
    # past it the request is aborted and answered 504 (--request-timeout-s).
    request_timeout_s: float | None = None
    # Seconds the whole request body may take to arrive (408 after).
    body_timeout_s: float = 30.0
    # Run chat templates that requests bring (--trust-request-chat-template): a template is
    # code, and the model's own is the only one trusted by default.
    trust_request_chat_template: bool = False
    # Seconds of CPU time a chat template may use to render before it is stopped (400), its
    # thread's own (waiting for the CPU or the GIL does not count); a wall-clock backstop
    # of tandem.core.llm.time_limit.WALL_FACTOR times it stops one that makes no progress.
    template_time_limit_s: float = 5.0
    # Sequences one request may ask for: prompts x n (--max-sequences-per-request); past
    # it, a 400 before anything is tokenized.
    max_sequences_per_request: int = 1024
    # Messages one chat or /tokenize request may bring (--max-chat-messages).
    max_chat_messages: int = 10_000
    # Tokens one /tokenize may produce, or /detokenize take (--max-tokenize-tokens); None:
    # the larger of DEFAULT_TOKENIZE_TOKENS and the model's context length.
    max_tokenize_tokens: int | None = None
    # Seconds a request's headers may take to arrive, from the connection's first byte (or
    # from the first byte after the previous answer) (--request-header-timeout-s).
    header_timeout_s: float = 20.0
    # Seconds an idle keep-alive connection stays open between requests
    # (--keep-alive-timeout-s).
    keep_alive_timeout_s: float = 5.0
    # Open client connections at most (--max-connections); None: what the open-file limit
    # leaves room for (tandem.server.connections.connection_cap).
    max_connections: int | None = None
    # Processes that prepare large bodies (parse, template, tokenize) away from the serving
    # process's GIL, tokenizer lock and event loop (--prepare-processes; 0: none).
    prepare_processes: int = 2


DEFAULT_TOKENIZE_TOKENS = 131_072


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
    limits: ServerLimits = field(default_factory=ServerLimits)
    preparer: RequestPreparer = field(default_factory=RequestPreparer)

    def __post_init__(self) -> None:
        self.metrics.count_preparation(lambda: self.preparer.jobs_running)

    @property
    def engine(self) -> LLMEngine:
        return self.loop.engine

    @property
    def async_engine(self) -> AsyncEngine:
        return AsyncEngine(self.loop)  # a stateless view; cheap to make per request
