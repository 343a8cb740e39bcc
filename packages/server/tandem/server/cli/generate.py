"""``tandem generate``: complete prompts offline and print the results.

With ``--json`` it prints exactly one JSON object per prompt, one per line, in prompt order:
``{"prompt_token_ids": [...], "token_ids": [...], "text": "...", "finish_reason": "..."}``.
Other tools rely on that contract; keep it stable.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from tandem.core import LLMEngine, SamplingParams
from tandem.core.executor.follower import run_follower
from tandem.core.llm.input_processor import Prompt
from tandem.core.llm.model_runner import LLMRunnerFactory
from tandem.core.llm.sequence import TokenLogprobs
from tandem.core.models.rec_config import is_rec_folder
from tandem.server.cli.engine_args import add_engine_args, engine_config_from_args, model_folder


class _AppendPrompt(argparse.Action):
    """--prompt and --prompt-token-ids share one list, so their order is kept."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        prompts = getattr(namespace, self.dest, None) or []
        if option_string == "--prompt-token-ids":
            try:
                values = [int(v) for v in str(values).split(",") if v.strip()]
            except ValueError:
                parser.error(f"--prompt-token-ids takes comma-separated integers, got {values!r}")
        prompts.append(values)
        setattr(namespace, self.dest, prompts)


def add_parser(subparsers: Any, parents: list[argparse.ArgumentParser]) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "generate", help="complete prompts and print the results", parents=parents
    )
    p.add_argument(
        "--prompt",
        dest="prompts",
        action=_AppendPrompt,
        metavar="TEXT",
        help="a prompt (repeatable)",
    )
    p.add_argument(
        "--prompt-token-ids",
        dest="prompts",
        action=_AppendPrompt,
        metavar="IDS",
        help="a prompt as comma-separated token ids (repeatable)",
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    p.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="N",
        help="with --json: each generated token's logprob and the N most likely (0: its own only)",
    )
    p.add_argument(
        "--prompt-logprobs",
        type=int,
        default=None,
        metavar="N",
        help="with --json: each prompt token's logprob (the first has none) and the N most likely",
    )
    add_engine_args(p)
    # A server comes to use its whole KV pool (never-used blocks go first) and backs it at
    # start-up so requests do not; a batch of prompts uses only what it needs, so generate
    # leaves the pages to their first use.
    p.set_defaults(func=run, prefault_kv_cache=False)


def _logprobs_record(position: TokenLogprobs) -> dict[str, Any]:
    return {
        "token_id": position.token_id,
        "logprob": position.logprob,
        "top": [[token, logprob] for token, logprob in position.top],
    }


def run(args: argparse.Namespace) -> int:
    if is_rec_folder(Path(model_folder(args))):
        print(
            f"error: {args.model} is a generative recommender, not a language model; serve it "
            "with `tandem serve --model DIR` (POST /v1/recommendations) or measure it with "
            "`tandem bench rec --model DIR`",
            file=sys.stderr,
        )
        return 2
    if (args.logprobs is not None or args.prompt_logprobs is not None) and not args.json:
        print("error: --logprobs and --prompt-logprobs are printed with --json", file=sys.stderr)
        return 2
    prompts: list[Prompt] = args.prompts or []
    if not prompts and args.node_rank == 0:
        print("error: give at least one --prompt TEXT or --prompt-token-ids 1,2,3", file=sys.stderr)
        return 2
    params = [
        SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=None if args.seed is None else args.seed + i,
            stop=list(args.stop),
            ignore_eos=args.ignore_eos,
            logprobs=args.logprobs,
            prompt_logprobs=args.prompt_logprobs,
        )
        for i in range(len(prompts))
    ]
    config = engine_config_from_args(args)
    if config.parallel.node_rank > 0:
        run_follower(config, LLMRunnerFactory.from_folder(Path(config.model.model)))
        return 0
    engine = LLMEngine(config)
    try:
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        elapsed = time.perf_counter() - start
    finally:
        engine.shutdown()
    for prompt, out in zip(prompts, outputs, strict=True):
        if args.json:
            record: dict[str, Any] = {
                "prompt_token_ids": out.prompt_token_ids,
                "token_ids": out.token_ids,
                "text": out.text,
                "finish_reason": out.finish_reason,
                "num_cached_tokens": out.num_cached_tokens,
            }
            if out.logprobs is not None:
                record["logprobs"] = [_logprobs_record(t) for t in out.logprobs]
            if out.prompt_logprobs is not None:
                record["prompt_logprobs"] = [
                    None if t is None else _logprobs_record(t) for t in out.prompt_logprobs
                ]
            print(json.dumps(record, ensure_ascii=False))
        else:
            shown = prompt if isinstance(prompt, str) else f"<{len(prompt)} token ids>"
            print(f"--- {shown!r} ({out.finish_reason})\n{out.text}")
    generated = sum(len(o.token_ids) for o in outputs)
    print(
        f"{len(outputs)} prompts, {generated} generated tokens in {elapsed:.2f} s "
        f"({generated / elapsed:.1f} tokens/s)",
        file=sys.stderr,
    )
    errors = [o for o in outputs if o.finish_reason == "error"]
    return 1 if errors else 0
