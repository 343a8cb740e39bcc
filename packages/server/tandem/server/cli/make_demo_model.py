"""``tandem make-demo-model DIR``: write the embedded default model, or a demo model of another
kind (a generative recommender, a Qwen3.5 hybrid, a Qwen3-MoE model) in one of its presets."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from tandem.core.demo.demo_model import PRESETS as LLM_PRESETS
from tandem.core.demo.demo_model import DemoModelSpec, write_demo_model
from tandem.core.demo.family_demo_model import (
    QWEN3_5_PRESETS,
    QWEN3_MOE_PRESETS,
    Qwen3_5DemoSpec,
    Qwen3MoeDemoSpec,
    write_qwen3_5_demo_model,
    write_qwen3_moe_demo_model,
)
from tandem.core.demo.rec_demo_model import RecDemoSpec, write_rec_demo_model

# Writes a model into a folder with a seed.
Writer = Callable[[Path, int], Path]


def _llm(spec: DemoModelSpec) -> Writer:
    return lambda folder, seed: write_demo_model(folder, replace(spec, seed=seed))


def _qwen3_5(spec: Qwen3_5DemoSpec) -> Writer:
    return lambda folder, seed: write_qwen3_5_demo_model(folder, replace(spec, seed=seed))


def _qwen3_moe(spec: Qwen3MoeDemoSpec) -> Writer:
    return lambda folder, seed: write_qwen3_moe_demo_model(folder, replace(spec, seed=seed))


# Per kind, its presets.
PRESETS: dict[str, dict[str, Writer]] = {
    "llm": {name: _llm(spec) for name, spec in LLM_PRESETS.items()},
    "rec": {"demo": lambda folder, seed: write_rec_demo_model(folder, RecDemoSpec(seed=seed))},
    "qwen3_5": {name: _qwen3_5(spec) for name, spec in QWEN3_5_PRESETS.items()},
    "qwen3_moe": {name: _qwen3_moe(spec) for name, spec in QWEN3_MOE_PRESETS.items()},
}


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
        choices=sorted(PRESETS),
        default="llm",
        help="llm: the Qwen3-architecture demo model; rec: a random generative recommender "
        "(encoder-decoder with cross-attention, semantic-id catalog); qwen3_5: a Qwen3.5 "
        "hybrid (Gated DeltaNet and gated full attention); qwen3_moe: a Qwen3-MoE model",
    )
    p.add_argument(
        "--preset",
        default="demo",
        help="the kind's size: demo (small, float32, the default) or, for "
        + ", ".join(kind for kind, presets in sorted(PRESETS.items()) if "bench" in presets)
        + ", bench: what the benchmarks run on (llm: Qwen3-shaped, 111M parameters, bfloat16 "
        "weights; qwen3_5 and qwen3_moe: ~100M parameters, float32)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    presets = PRESETS[args.kind]
    writer = presets.get(args.preset)
    if writer is None:
        print(
            f"error: --kind {args.kind} has the presets {', '.join(sorted(presets))}, "
            f"not {args.preset!r}",
            file=sys.stderr,
        )
        return 2
    print(writer(Path(args.dir), args.seed), file=sys.stderr)
    return 0
