"""``tandem serve``: the OpenAI-compatible HTTP server over one engine."""

from __future__ import annotations

import argparse
import logging
import signal
from pathlib import Path
from typing import Any

import uvicorn

from tandem.core import ConfigError, EngineConfig, EngineLoop, LLMEngine
from tandem.core.executor.follower import run_follower
from tandem.core.llm.model_runner import LLMRunnerFactory
from tandem.core.models.rec_config import is_rec_folder
from tandem.core.rec.service import RecService
from tandem.server.cli.chat_args import add_chat_args, chat_config_from_args
from tandem.server.cli.engine_args import add_engine_args, engine_config_from_args
from tandem.server.connections import (
    ConnectionGuard,
    connection_cap,
    file_limit,
    guarded_protocol,
    open_descriptors,
)
from tandem.server.metrics import ServerMetrics
from tandem.server.startup_heap import freeze_startup_objects
from tandem.server.state import DEFAULT_TOKENIZE_TOKENS, ServerLimits, ServerState
from tandem.server.supervision import EXIT_ENGINE_FAILED, SupervisedServer

logger = logging.getLogger(__name__)


def _after_shutdown(signum: int, _frame: object) -> None:
    logger.info("received %s during shutdown", signal.Signals(signum).name)


def add_parser(subparsers: Any, parents: list[argparse.ArgumentParser]) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API", parents=parents
    )
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model folder, as `vllm serve MODEL` takes it (same as --model)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model name(s) clients send (default: the folder's name); the first is the "
        "one responses carry",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default loopback only; 0.0.0.0 for all)",
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every request but /health and /metrics",
    )
    p.add_argument(
        "--max-request-body-mb",
        type=float,
        default=8.0,
        help="refuse larger request bodies with 413",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds the connections get to drain on SIGINT/SIGTERM (requests still "
        "generating are answered with an error first)",
    )
    p.add_argument(
        "--request-timeout-s",
        type=float,
        default=None,
        help="wall-clock seconds a request may take; past it, it is aborted and answered "
        "504 (default: no limit)",
    )
    p.add_argument(
        "--request-body-timeout-s",
        type=float,
        default=30.0,
        help="seconds a request body may take to arrive before it is answered 408",
    )
    p.add_argument(
        "--request-header-timeout-s",
        type=float,
        default=20.0,
        help="seconds a request's headers may take to arrive (a connection that sends "
        "nothing, or trickles its headers, is closed; 408 once some arrived)",
    )
    p.add_argument(
        "--keep-alive-timeout-s",
        type=float,
        default=5.0,
        help="seconds an idle keep-alive connection stays open between requests",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="open client connections at most; past it new ones get 503 at once (default, "
        "and never more than: what the open-file limit leaves after a reserve)",
    )
    p.add_argument(
        "--prepare-processes",
        type=int,
        default=2,
        help="processes that parse, render and tokenize large request bodies (over 64 KiB) "
        "away from serving, started on first use; 0: in the server's own threads",
    )
    p.add_argument(
        "--max-sequences-per-request",
        type=int,
        default=1024,
        help="sequences one request may ask for (prompts x n); more is a 400",
    )
    p.add_argument(
        "--max-chat-messages",
        type=int,
        default=10_000,
        help="messages one chat or /tokenize request may bring; more is a 400",
    )
    p.add_argument(
        "--max-tokenize-tokens",
        type=int,
        default=None,
        help="tokens one /tokenize may produce or /detokenize take; more is a 400 (default: "
        f"{DEFAULT_TOKENIZE_TOKENS} or the context length, whichever is larger)",
    )
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="run chat templates that requests bring (chat_template); a template is code, "
        "so by default only the model's own runs",
    )
    p.add_argument(
        "--exit-on-engine-failure",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"once the engine fails, drain and exit with status {EXIT_ENGINE_FAILED} so a "
        "supervisor restarts the server (--no-exit-on-engine-failure keeps it up, answering "
        "503, for debugging)",
    )
    add_chat_args(p)
    add_engine_args(p)
    p.add_argument(
        "--seed",
        dest="engine_seed",
        type=int,
        default=argparse.SUPPRESS,
        help="same as --engine-seed (vLLM's name)",
    )
    vllm = p.add_argument_group(
        "vLLM flags accepted as they are, so a vLLM launch line runs unchanged"
    )
    vllm.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto" works whenever --tool-call-parser is set',
    )
    vllm.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="Tandem runs no code from model folders, so there is nothing to trust",
    )
    vllm.add_argument(
        "--disable-log-requests", action="store_true", help="Tandem does not log requests"
    )
    p.set_defaults(func=run)


def apply_model_tag(args: argparse.Namespace) -> None:
    """``tandem serve MODEL`` (vLLM's way) means ``--model MODEL``."""
    if args.model_tag is None:
        return
    if args.model is not None and args.model != args.model_tag:
        raise ConfigError(f"two models named: {args.model_tag} and --model {args.model}; name one")
    args.model = args.model_tag


def _limits(args: argparse.Namespace) -> ServerLimits:
    for name in (
        "request_timeout_s", "request_body_timeout_s", "request_header_timeout_s",
        "keep_alive_timeout_s", "max_connections", "max_sequences_per_request",
        "max_chat_messages", "max_tokenize_tokens",
    ):  # fmt: skip
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if args.prepare_processes < 0:
        raise ConfigError(f"--prepare-processes must be >= 0, got {args.prepare_processes}")
    return ServerLimits(
        request_timeout_s=args.request_timeout_s,
        body_timeout_s=args.request_body_timeout_s,
        trust_request_chat_template=args.trust_request_chat_template,
        max_sequences_per_request=args.max_sequences_per_request,
        max_chat_messages=args.max_chat_messages,
        max_tokenize_tokens=args.max_tokenize_tokens,
        header_timeout_s=args.request_header_timeout_s,
        keep_alive_timeout_s=args.keep_alive_timeout_s,
        max_connections=args.max_connections,
        prepare_processes=args.prepare_processes,
    )


def run(args: argparse.Namespace) -> int:
    apply_model_tag(args)
    limits = _limits(args)
    config = engine_config_from_args(args)
    folder = Path(config.model.model)
    names = args.served_model_name or [folder.resolve().name]
    name = names[0]
    if is_rec_folder(folder):
        return _serve_rec(args, config, name, limits)
    if config.parallel.node_rank > 0:
        # Node 0 serves HTTP; this node only lends its devices.
        run_follower(config, LLMRunnerFactory.from_folder(Path(config.model.model)))
        return 0
    # Flags that cannot work fail before the model loads.
    chat_config = chat_config_from_args(args)
    # Imported here, as in _serve_rec: FastAPI costs every other command half a second.
    from tandem.server.app import create_app

    engine = LLMEngine(config)
    metrics = ServerMetrics(engine, name)
    loop = EngineLoop(engine, on_finished=metrics.observe_finished)
    state = ServerState(
        loop=loop,
        served_model_name=name,
        metrics=metrics,
        api_key=args.api_key,
        max_body_bytes=int(args.max_request_body_mb * (1 << 20)),
        model_aliases=tuple(names[1:]),
        chat=chat_config,
        limits=limits,
    )
    guard = _connection_guard(limits)
    server = SupervisedServer(
        _uvicorn_config(create_app(state), args, limits, guard),
        abort_all=loop.abort_all,
        engine_failure=lambda: engine.dead,
        exit_on_engine_failure=args.exit_on_engine_failure,
        every_second=guard.check_descriptors,
    )
    logger.info("serving %s as %r on http://%s:%d", folder, name, args.host, args.port)
    try:
        _run_server(server)
    finally:
        loop.stop()
    return _stopped(server)


def _stopped(server: SupervisedServer) -> int:
    if server.failure is not None:
        logger.error("server stopped: the engine failed (%s)", server.failure)
    else:
        logger.info("server stopped")
    return server.exit_code


def _run_server(server: uvicorn.Server) -> None:
    # uvicorn handles SIGINT/SIGTERM while it runs (stop accepting, drain, shut down), then
    # re-raises the signal under the handler it found. Finding this one, the re-raise is a
    # no-op and the process exits 0 after a clean shutdown.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _after_shutdown)
    freeze_startup_objects()
    server.run()


def _connection_guard(limits: ServerLimits) -> ConnectionGuard:
    """The connection cap, from the open-file limit and what is open once the engine is up
    (its files, pipes and threads' descriptors), logged with the reason for it."""
    limit = file_limit()
    cap, why = connection_cap(limits.max_connections, limit, open_descriptors() or 0)
    logger.info("%s", why)
    return ConnectionGuard(cap=cap, header_timeout_s=limits.header_timeout_s, file_limit=limit)


def _uvicorn_config(
    app: Any, args: argparse.Namespace, limits: ServerLimits, guard: ConnectionGuard
) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=int(args.shutdown_timeout),
        timeout_keep_alive=max(1, round(limits.keep_alive_timeout_s)),
        http=guarded_protocol(guard),
    )


def _serve_rec(
    args: argparse.Namespace, config: EngineConfig, name: str, limits: ServerLimits
) -> int:
    """A generative recommender: the fixed-steps engine behind /v1/recommendations."""
    from tandem.server.rec_app import RecMetrics, RecServerState, create_rec_app

    service = RecService(config)
    state = RecServerState(
        service=service,
        served_model_name=name,
        metrics=RecMetrics(service, name),
        api_key=args.api_key,
        max_body_bytes=int(args.max_request_body_mb * (1 << 20)),
        limits=limits,
    )
    guard = _connection_guard(limits)
    server = SupervisedServer(
        _uvicorn_config(create_rec_app(state), args, limits, guard),
        abort_all=service.refuse_new,
        engine_failure=lambda: service.dead,
        exit_on_engine_failure=args.exit_on_engine_failure,
        every_second=guard.check_descriptors,
    )
    logger.info("serving recommender %s as %r on http://%s:%d", config.model.model, name,
                args.host, args.port)  # fmt: skip
    try:
        _run_server(server)
    finally:
        service.shutdown()
    return _stopped(server)
