"""``tandem make-demo-model DIR``: write the embedded default model."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from tandem.core.demo.demo_model import PRESETS, write_demo_model
from tandem.core.demo.rec_demo_model import RecDemoSpec, write_rec_demo_model


def add_parser(subparsers: Any, parents: list[argparse.ArgumentParser]) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "make-demo-model",
        help="write the embedded default model (random Qwen3 weights, trained BPE tokenizer)",
        parents=parents,
    )
    p.add_argument("dir", help="output folder (created if missing)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--kind",
        choices=["llm", "rec"],
        default="llm",
        help="llm: the Qwen3-architecture demo model; rec: a random generative recommender "
        "(encoder-decoder with cross-attention, semantic-id catalog)",
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="demo",
        help="llm size: demo (small, float32) or bench (Qwen3-shaped, 111M parameters, "
        "bfloat16 weights: what the benchmarks run on)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.kind == "rec":
        path = write_rec_demo_model(Path(args.dir), RecDemoSpec(seed=args.seed))
    else:
        path = write_demo_model(args.dir, replace(PRESETS[args.preset], seed=args.seed))
    print(path, file=sys.stderr)
    return 0
