"""Random prompts of controlled length, given as token ids so the length is exact."""

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
) -> list[BenchRequest]:
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    # Skip the lowest ids, where tokenizers keep their special tokens.
    low = min(16, vocab_size - 1)
    return [
        BenchRequest(
            prompt_token_ids=[
                rng.randrange(low, vocab_size) for _ in range(_length(rng, input_len, range_ratio))
            ],
            output_len=_length(rng, output_len, range_ratio),
        )
        for _ in range(num)
    ]
