"""The tokens the demo models (dense Qwen3, hybrid Qwen3.5, Qwen3-MoE) generate for a fixed
set of prompts under sampling settings that cover every logit edit: greedy, seeded sampling
with temperature / top_p / top_k, the presence, frequency and repetition penalties, min_p,
logit_bias and min_tokens, alone and mixed in one batch, under several engine layouts (one
step at a time, steps launched ahead, two pipeline lanes, a KV cache small enough to
preempt). Written to a JSON file; ``--compare`` runs again and checks the tokens are the
same, so a change to the sampler can be shown to leave outputs bit-identical.

    python benchmarks/sampling_equality.py --out /tmp/sampling_before.json
    python benchmarks/sampling_equality.py --compare /tmp/sampling_before.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandem.core import CacheConfig, EngineConfig, LLMEngine, ModelLoadConfig, SchedulerConfig
from tandem.core.config import PipelineConfig
from tandem.core.demo.demo_model import tiny_spec, write_demo_model
from tandem.core.demo.family_demo_model import (
    Qwen3_5DemoSpec,
    Qwen3MoeDemoSpec,
    write_qwen3_5_demo_model,
    write_qwen3_moe_demo_model,
)
from tandem.core.llm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PROMPTS = [
    "the quick brown fox",
    "once upon a time there was",
    "ba ba ba ba ba ba",
    "hello",
]

_MODELS: dict[str, Callable[[Path], Path]] = {
    "dense": lambda folder: write_demo_model(folder, tiny_spec()),
    "hybrid": lambda folder: write_qwen3_5_demo_model(
        folder,
        Qwen3_5DemoSpec(
            hidden_size=64, intermediate_size=128, num_layers=2, full_attention_interval=2,
            num_heads=2, num_kv_heads=1, head_dim=32, linear_key_head_dim=16,
            linear_value_head_dim=16, vocab_size=512, max_position_embeddings=512,
            init_std=0.2,
        ),
    ),
    "moe": lambda folder: write_qwen3_moe_demo_model(
        folder,
        Qwen3MoeDemoSpec(
            hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
            num_experts=4, moe_intermediate_size=64, vocab_size=512,
            max_position_embeddings=512, init_std=0.2,
        ),
    ),
}  # fmt: skip

# Engine layouts: (num_blocks, block_size, max_concurrency, overlap_steps).
_LAYOUTS: dict[str, tuple[int, int, int, bool]] = {
    "one-step": (256, 16, 1, False),
    "launch-ahead": (256, 16, 1, True),
    "two-lanes": (256, 16, 2, False),
    "preempting": (10, 4, 1, False),
}


def settings(eos: int) -> dict[str, dict[str, Any]]:
    """Named SamplingParams keyword sets; ``eos`` is the model's end-of-sequence token."""
    seeded = {"temperature": 0.9, "seed": 7}
    return {
        "greedy": {"temperature": 0.0},
        "seeded": {"temperature": 0.8, "seed": 11},
        "seeded-top-p-top-k": {"temperature": 1.2, "top_p": 0.9, "top_k": 40, "seed": 3},
        "presence": {"temperature": 0.0, "presence_penalty": 1.5},
        "frequency": {"temperature": 0.0, "frequency_penalty": 1.0},
        "repetition": {"temperature": 0.0, "repetition_penalty": 1.8},
        "penalties-seeded": {
            **seeded, "presence_penalty": 0.5, "frequency_penalty": 0.4,
            "repetition_penalty": 1.3,
        },
        "negative-penalties": {
            "temperature": 0.0, "presence_penalty": -1.0, "repetition_penalty": 0.7,
        },
        "min-p": {**seeded, "temperature": 1.5, "min_p": 0.2},
        "min-p-greedy": {"temperature": 0.0, "min_p": 0.3},
        "logit-bias": {"temperature": 0.0, "logit_bias": {5: 8.0, 17: 6.0, 40: -100.0}},
        "logit-bias-seeded": {**seeded, "logit_bias": {9: 3.0, 11: 3.0}},
        "min-tokens": {"temperature": 0.0, "min_tokens": 10, "logit_bias": {eos: 50.0}},
        "min-tokens-stop-ids": {
            **seeded, "min_tokens": 6, "stop_token_ids": [5, 6], "logit_bias": {5: 20.0},
        },
        "everything": {
            "temperature": 1.1, "top_p": 0.95, "top_k": 64, "seed": 5, "min_p": 0.05,
            "presence_penalty": 0.3, "frequency_penalty": 0.2, "repetition_penalty": 1.1,
            "logit_bias": {eos: 4.0, 30: 2.0}, "min_tokens": 4,
        },
    }  # fmt: skip


def _engine(model: Path, layout: str) -> LLMEngine:
    num_blocks, block_size, lanes, overlap = _LAYOUTS[layout]
    return LLMEngine(
        EngineConfig(
            model=ModelLoadConfig(model=str(model)),
            cache=CacheConfig(
                block_size=block_size, num_blocks=num_blocks, enable_prefix_cache=False
            ),
            scheduler=SchedulerConfig(max_tokens_per_batch=64, max_seqs_per_batch=16),
            pipeline=PipelineConfig(max_concurrency=lanes, overlap_steps=overlap),
        )
    )


def run(models_dir: Path, max_tokens: int) -> dict[str, Any]:
    """``{model: {layout: {"alone": {setting: [tokens per prompt]}, "mixed": [...]}}}``."""
    results: dict[str, Any] = {}
    for name, write in _MODELS.items():
        folder = models_dir / name
        if not (folder / "config.json").exists():
            write(folder)
        results[name] = {}
        for layout in _LAYOUTS:
            engine = _engine(folder, layout)
            try:
                eos = min(engine.inputs.eos_token_ids)
                named = settings(eos)
                alone: dict[str, list[list[int]]] = {}
                for setting, kwargs in named.items():
                    params = SamplingParams(max_tokens=max_tokens, **kwargs)
                    outs = engine.generate(PROMPTS, params)
                    alone[setting] = [out.token_ids for out in outs]
                # Every setting in one batch: rows come and go while others run.
                prompts = [p for p in PROMPTS for _ in named]
                mixed_params = [
                    SamplingParams(max_tokens=max_tokens + i % 5, **kwargs)
                    for _ in PROMPTS
                    for i, kwargs in enumerate(named.values())
                ]
                mixed = [out.token_ids for out in engine.generate(prompts, mixed_params)]
            finally:
                engine.shutdown()
            results[name][layout] = {"alone": alone, "mixed": mixed}
            logger.info("%s / %s done", name, layout)
    return results


def differences(old: Any, new: Any, path: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = [f"{path}/{key}: missing" for key in old.keys() ^ new.keys()]
        for key in old.keys() & new.keys():
            out += differences(old[key], new[key], f"{path}/{key}")
        return out
    return [] if old == new else [f"{path}: {old} != {new}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the tokens here")
    parser.add_argument("--compare", type=Path, help="check the tokens equal this file's")
    parser.add_argument("--models-dir", type=Path, help="demo models (written if absent)")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.out is None and args.compare is None:
        parser.error("give --out, --compare or both")
    with tempfile.TemporaryDirectory() as scratch:
        results = run(args.models_dir or Path(scratch), args.max_tokens)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")
    if args.compare is not None:
        diffs = differences(json.loads(args.compare.read_text(encoding="utf-8")), results)
        count = sum(len(runs) for model in results.values() for runs in model.values())
        if diffs:
            print(f"{len(diffs)} differences from {args.compare}:")
            for line in diffs[:50]:
                print(" ", line)
            return 1
        print(f"identical to {args.compare} ({count} runs over {len(results)} models)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
