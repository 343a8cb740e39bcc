"""Where a step's time goes with and without the MTP head: the worker's forward, its Gated
DeltaNet layers (and their verify paths), the head's first pass and its later drafts, summed
over one 256-token prompt's 96 new tokens after a warm-up run.

    python benchmarks/results/2026-12-05-mtp-chain-zen4/step_parts.py K [--model DIR]

K = 0 serves without speculation.
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable
from typing import Any

from tandem.core import LLMEngine, SamplingParams
from tandem.core.config import CacheConfig, EngineConfig, ModelLoadConfig, SpeculativeConfig
from tandem.core.layers import gated_delta_net
from tandem.core.llm import model_runner

SPENT: collections.defaultdict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter[str] = collections.Counter()


def timed(owner: type, name: str, key: str | None = None) -> None:
    """Replace ``owner.name`` by a wrapper that adds its wall time to ``SPENT[key]``."""
    original: Callable[..., Any] = getattr(owner, name)
    label = key or name

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        result = original(*args, **kwargs)
        SPENT[label] += time.perf_counter() - started
        CALLS[label] += 1
        return result

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("k", type=int)
    parser.add_argument("--model", default="/tmp/story-bench")
    args = parser.parse_args()
    runner = model_runner.ModelRunner
    for name in ("_forward", "_sample", "_draft_ahead", "_later_drafts"):
        timed(runner, name)
    layer = gated_delta_net.GatedDeltaNet
    timed(layer, "forward", "gated_delta_net")
    for name in ("_verify_conv", "_verify_delta"):
        timed(layer, name)
    spec = None
    if args.k:
        spec = SpeculativeConfig(method="mtp", num_speculative_tokens=args.k)
    engine = LLMEngine(
        EngineConfig(
            model=ModelLoadConfig(model=args.model, dtype="bfloat16"),
            cache=CacheConfig(num_blocks=512),
            speculative=spec,
        )
    )
    params = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    prompt = list(range(5, 261))
    engine.generate([prompt], params)
    SPENT.clear()
    CALLS.clear()
    started = time.perf_counter()
    engine.generate([prompt], params)
    total = time.perf_counter() - started
    parts = {n: f"{SPENT[n] * 1e3:.1f} ms / {CALLS[n]} calls" for n in SPENT}
    print(f"K={args.k}: {total:.3f} s; {parts}")
    engine.shutdown()


if __name__ == "__main__":
    main()
