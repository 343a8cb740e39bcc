"""``tandem bench serve``: the serving benchmark (like ``vllm bench serve``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Any

from tandem.server.bench.rec import SETTINGS, Workload, format_rec_table, run_interleaved, run_one
from tandem.server.bench.soak_server import TOPOLOGIES
from tandem.server.bench.soak_workload import Mix


def add_parser(subparsers: Any, parents: list[argparse.ArgumentParser]) -> None:
    bench: argparse.ArgumentParser = subparsers.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    p: argparse.ArgumentParser = kinds.add_parser(
        "serve",
        help="load a running OpenAI-compatible server and report latency/throughput",
        parents=parents,
    )
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--num-prompts", type=int, default=96)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="lengths drawn uniformly from len*(1-r) .. len*(1+r)",
    )
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument(
        "--prompt-repeats",
        type=int,
        default=1,
        help="each prompt is a random segment repeated this many times (a quoting workload, "
        "for n-gram speculative decoding; default 1: all random); with --shared-prefix-len, "
        "only each prompt's own part after the prefix is repeated",
    )
    p.add_argument(
        "--shared-prefix-len",
        type=_non_negative_int,
        default=0,
        help="open every measured prompt with one fixed random prefix of this many tokens "
        "(from --seed), followed by its own --input-len random tokens, and report the "
        "server's prefix-cache hit rate; warm-ups get a different prefix, so the first "
        "measured request misses (default 0: no shared prefix)",
    )
    p.add_argument(
        "--turns",
        type=_positive_int,
        default=1,
        help="turns per conversation: --num-prompts conversations, each turn's prompt the "
        "turn before it, its generated tokens (asked for as token ids) and a new random user "
        "message of --input-len tokens; the turns of one conversation go one after another, "
        "conversations (not requests) arrive by --request-rate and count against "
        "--max-concurrency; reports turn 1's TTFT against the later turns' "
        "(default 1: single requests; warm-ups stay single requests)",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals (default: all at once)",
    )
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--num-warmups", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="token-id range of the random prompts (default: from /v1/models)",
    )
    p.add_argument("--result-json", default=None, help="also write the figures to this file")
    p.set_defaults(func=run)

    r: argparse.ArgumentParser = kinds.add_parser(
        "rec",
        help="requests/s and latency of a recommender for several pipeline settings, "
        "interleaved, each in its own process",
        parents=parents,
    )
    r.add_argument(
        "--model", required=True, help="a recommender folder (make-demo-model --kind rec)"
    )
    r.add_argument(
        "--settings",
        default=",".join(SETTINGS),
        help=f"comma-separated, from: {', '.join(SETTINGS)}",
    )
    r.add_argument("--rounds", type=int, default=2, help="interleaved rounds (A B C A B C)")
    r.add_argument("--num-requests", type=int, default=256)
    r.add_argument("--history-len", type=int, default=64)
    r.add_argument("--num-candidates", type=int, default=10)
    r.add_argument("--client-concurrency", type=int, default=64, help="requests kept outstanding")
    r.add_argument("--batch-size", type=int, default=16, help="requests per batch")
    r.add_argument("--devices", default="cpu:0")
    r.add_argument("--num-blocks", type=int, default=1024, help="KV blocks (16 items each)")
    r.add_argument("--result-json", default=None)
    r.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    r.set_defaults(func=run_rec)

    k: argparse.ArgumentParser = kinds.add_parser(
        "soak",
        help="start a server and hold it under mixed, adversarial load for a bounded time: "
        "outcomes, latency, memory and threads over the run, and a server back at rest",
        parents=parents,
    )
    k.add_argument("--model", required=True, help="a model folder (LLM or recommender)")
    k.add_argument("--topology", choices=TOPOLOGIES, default="tp1")
    k.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    k.add_argument("--concurrency", type=int, default=128, help="requests kept in flight")
    k.add_argument("--disconnect-rate", type=float, default=0.2,
                   help="share of requests the client abandons at a random point")  # fmt: skip
    k.add_argument("--malformed-rate", type=float, default=0.05,
                   help="share of requests malformed on purpose (must get a 4xx)")  # fmt: skip
    k.add_argument("--max-prompt", type=int, default=300, help="longest prompt, in tokens")
    k.add_argument("--max-tokens", type=int, default=64, help="most tokens a request asks for")
    k.add_argument("--num-blocks", type=int, default=48,
                   help="the server's KV blocks (few: long prompts force preemption)")  # fmt: skip
    k.add_argument("--max-waiting-requests", type=int, default=96,
                   help="the server's bound on waiting requests (503 past it)")  # fmt: skip
    k.add_argument("--server-arg", action="append", default=[],
                   help="one more flag for tandem serve (repeat for several)")  # fmt: skip
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--result-json", default=None, help="also write the figures to this file")
    k.set_defaults(func=run_soak_command)


def _int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    return _int_at_least(text, least=0)


def _positive_int(text: str) -> int:
    return _int_at_least(text, least=1)


def run_soak_command(args: argparse.Namespace) -> int:
    # Imported here: the HTTP clients cost every other command 0.4 s of start-up.
    import httpx

    from tandem.server.bench.soak import SoakConfig, format_report, run_soak

    for name in ("duration", "concurrency", "num_blocks", "max_waiting_requests", "max_prompt",
                 "max_tokens"):  # fmt: skip
        if getattr(args, name) <= 0:
            print(f"error: --{name.replace('_', '-')} must be > 0", file=sys.stderr)
            return 2
    for name in ("disconnect_rate", "malformed_rate"):
        if not 0 <= getattr(args, name) <= 1:
            print(f"error: --{name.replace('_', '-')} must be in [0, 1]", file=sys.stderr)
            return 2
    config = SoakConfig(
        model=Path(args.model),
        topology=args.topology,
        duration_s=args.duration,
        concurrency=args.concurrency,
        mix=Mix(
            disconnect_rate=args.disconnect_rate,
            malformed_rate=args.malformed_rate,
            max_prompt=args.max_prompt,
            max_tokens=args.max_tokens,
        ),
        server_args=[
            "--num-blocks",
            str(args.num_blocks),
            "--max-waiting-requests",
            str(args.max_waiting_requests),
            *args.server_arg,
        ],
        seed=args.seed,
    )

    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        report = run_soak(config)
    except (OSError, RuntimeError, httpx.HTTPError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_report(report))
    if args.result_json:
        figures = {
            "kind": report.kind, "topology": report.topology, "duration_s": report.duration_s,
            "concurrency": report.concurrency, "outcomes": dict(report.outcomes),
            "samples": {k: vars(v) for k, v in report.samples.items()},
            "peak_rss_mib": report.peak_rss_mib,
            "rest": report.rest, "exit_status": report.exit_status,
            "problems": report.problems(),
        }  # fmt: skip
        Path(args.result_json).write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    return 0 if not report.problems() else 1


def run_rec(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.settings.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown or not names:
        print(f"error: unknown setting(s) {unknown}; choose from {', '.join(SETTINGS)}",
              file=sys.stderr)  # fmt: skip
        return 2
    for name in ("num_requests", "history_len", "num_candidates", "client_concurrency",
                 "batch_size", "rounds", "num_blocks"):  # fmt: skip
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    workload = Workload(
        num_requests=args.num_requests,
        history_len=args.history_len,
        num_candidates=args.num_candidates,
        client_concurrency=args.client_concurrency,
        batch_size=args.batch_size,
        devices=args.devices,
        num_blocks=args.num_blocks,
    )
    if args.child:
        print(json.dumps(run_one(Path(args.model), SETTINGS[names[0]], workload)))
        return 0
    results = run_interleaved(Path(args.model), [SETTINGS[n] for n in names], workload, args.rounds)
    print(format_rec_table(results))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(results, indent=2), encoding="utf-8")
    return 0


def run(args: argparse.Namespace) -> int:
    import aiohttp

    from tandem.server.bench.report import format_table
    from tandem.server.bench.runner import BenchConfig, run_benchmark, run_on_fast_loop

    for name in ("num_prompts", "input_len", "output_len", "prompt_repeats"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if args.max_concurrency is not None and args.max_concurrency < 1:
        print("error: --max-concurrency must be >= 1", file=sys.stderr)
        return 2
    if args.request_rate <= 0:
        print("error: --request-rate must be > 0 (or inf)", file=sys.stderr)
        return 2
    config = BenchConfig(
        base_url=args.base_url.rstrip("/"),
        model=args.model,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        ignore_eos=args.ignore_eos,
        num_warmups=args.num_warmups,
        seed=args.seed,
        api_key=args.api_key,
        vocab_size=args.vocab_size,
        prompt_repeats=args.prompt_repeats,
        shared_prefix_len=args.shared_prefix_len,
        turns=args.turns,
    )
    try:
        figures = run_on_fast_loop(run_benchmark(config))
    except (OSError, ValueError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(figures))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    return 0 if figures["failed"] == 0 else 1
