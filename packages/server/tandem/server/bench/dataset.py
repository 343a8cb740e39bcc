"""Random prompts of controlled length, given as token ids so the length is exact; with
repeats, each prompt is one random segment said over and over (a quoting workload, where
n-gram speculation finds its drafts)."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return rng.randint(low, high)


def random_requests(
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    seed: int,
    repeats: int = 1,
) -> list[BenchRequest]:
    """``repeats``: times each prompt's segment is repeated to fill it (1: no repetition)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    if repeats < 1:
        raise ValueError(f"--prompt-repeats must be >= 1, got {repeats}")
    rng = random.Random(seed)
    # Skip the lowest ids, where tokenizers keep their special tokens.
    low = min(16, vocab_size - 1)
    requests = []
    for _ in range(num):
        length = _length(rng, input_len, range_ratio)
        segment = [rng.randrange(low, vocab_size) for _ in range(-(-length // repeats))]
        requests.append(
            BenchRequest(
                prompt_token_ids=(segment * repeats)[:length],
                output_len=_length(rng, output_len, range_ratio),
            )
        )
    return requests
