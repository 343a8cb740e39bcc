"""The sampler's cost per step on CPU: greedy, temperature and top-p batches at decode batch
sizes and real vocabulary sizes; beside them, the top-p cut alone and the full sort it
replaced, and the exponential race (argmax of p / E, E ~ Exp(1)) that inverting the
cumulative distribution replaced; timed one after another in one process. Logits are
randn * --logit-scale: 3 (default) is a flat distribution whose 0.9-nucleus holds ~1000
tokens of 152K, a hard case; trained models are usually far more peaked.

    python benchmarks/sampler_step.py [--rows 1 8 48] [--vocab 16384 151936] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from tandem.core.llm.forward_input import SamplingBatch
from tandem.core.llm.sampler import Sampler, apply_top_k_top_p, top_k_top_p_by_sort

_WIDTHS = (5, 7, 8, 9, 10, 8, 9, 9)


def exponential_race(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> list[int]:
    """The previous way to draw: one Exp(1) number per vocabulary entry."""
    probs = (logits / temperature).softmax(dim=-1)
    noise = torch.empty(probs.shape, dtype=torch.float32).exponential_(generator=gen)
    result: list[int] = (probs / noise).argmax(dim=-1).tolist()
    return result


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 48])
    parser.add_argument("--vocab", type=int, nargs="+", default=[16384, 151936])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--logit-scale", type=float, default=3.0)
    args = parser.parse_args()
    print(f"{torch.get_num_threads()} threads; torch {torch.__version__}; ms per step, median")
    header = ("rows", "vocab", "greedy", "temp 0.8", "top_p 0.9", "cut", "sort cut", "exp race")
    print(" ".join(f"{name:>{width}}" for name, width in zip(header, _WIDTHS, strict=True)))
    sampler = Sampler(seed=0)
    gen = torch.Generator().manual_seed(0)
    for vocab in args.vocab:
        for rows in args.rows:
            logits = torch.randn(rows, vocab, generator=gen) * args.logit_scale
            figures = []
            for temperature, top_p in ((0.0, 1.0), (0.8, 1.0), (0.8, 0.9)):
                batch = SamplingBatch.uniform(rows, temperature, top_p)
                figures.append(_median_ms(partial(sampler, logits, batch), args.repeats))
            no_top_k = torch.zeros(rows, dtype=torch.int64)
            nucleus = torch.full((rows,), 0.9)
            scaled = logits / 0.8
            for cut in (apply_top_k_top_p, top_k_top_p_by_sort):
                figures.append(_median_ms(partial(cut, scaled, no_top_k, nucleus), args.repeats))
            race = partial(exponential_race, logits, temperature=0.8, gen=gen)
            figures.append(_median_ms(race, args.repeats))
            cells = [f"{rows:>5}", f"{vocab:>7}"]
            cells += [f"{ms:>{width}.2f}" for ms, width in zip(figures, _WIDTHS[2:], strict=True)]
            print(" ".join(cells), flush=True)


if __name__ == "__main__":
    main()
