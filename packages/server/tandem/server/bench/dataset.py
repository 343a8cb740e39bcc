"""Random prompts of controlled length, given as token ids so the length is exact; with
repeats, each prompt is one random segment said over and over (a quoting workload, where
n-gram speculation finds its drafts); with a shared prefix, every measured prompt opens with
the same random tokens (a system-prompt workload, where prefix caching pays); in a
conversation, each turn after the first carries the one before it and its answer."""

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


def _lowest_id(vocab_size: int) -> int:
    # Skip the lowest ids, where tokenizers keep their special tokens.
    return min(16, vocab_size - 1)


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
    return [
        _random_request(rng, input_len, output_len, range_ratio, vocab_size, repeats)
        for _ in range(num)
    ]


def _random_request(
    rng: random.Random,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    repeats: int,
) -> BenchRequest:
    length = _length(rng, input_len, range_ratio)
    low = _lowest_id(vocab_size)
    segment = [rng.randrange(low, vocab_size) for _ in range(-(-length // repeats))]
    return BenchRequest(
        prompt_token_ids=(segment * repeats)[:length],
        output_len=_length(rng, output_len, range_ratio),
    )


def next_turn(
    previous: BenchRequest,
    output_token_ids: list[int],
    rng: random.Random,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    repeats: int = 1,
) -> BenchRequest:
    """The turn after ``previous``, which the server answered with ``output_token_ids``:
    the whole conversation so far, then a new user message drawn as a first turn's own part
    is (``--input-len``, ``--range-ratio``, repeats), asking for as many tokens as one."""
    user = _random_request(rng, input_len, output_len, range_ratio, vocab_size, repeats)
    return BenchRequest(
        prompt_token_ids=previous.prompt_token_ids + output_token_ids + user.prompt_token_ids,
        output_len=user.output_len,
    )


def _prefix(length: int, vocab_size: int, seed: str) -> list[int]:
    # A stream of its own, so the per-request parts are the same tokens with or without one.
    rng = random.Random(seed)
    low = _lowest_id(vocab_size)
    return [rng.randrange(low, vocab_size) for _ in range(length)]


def split_warmups(
    requests: list[BenchRequest],
    num_warmups: int,
    shared_prefix_len: int,
    vocab_size: int,
    seed: int,
) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """The first ``num_warmups`` of ``requests`` to warm up with, and the rest to measure.
    With ``shared_prefix_len`` L > 0, every measured prompt is one fixed random prefix of L
    tokens followed by its own tokens, as given (repeats apply to that part only). The
    warm-ups open with another prefix of L tokens: they take the same shapes and paths
    through the server, yet leave nothing cached that the measured prefix could hit, so the
    first measured request misses."""
    if shared_prefix_len < 0:
        raise ValueError(f"--shared-prefix-len must be >= 0, got {shared_prefix_len}")
    warmups, measured = requests[:num_warmups], requests[num_warmups:]
    if shared_prefix_len == 0:
        return warmups, measured
    prefix = _prefix(shared_prefix_len, vocab_size, seed=f"shared-prefix-{seed}")
    decoy = _prefix(shared_prefix_len, vocab_size, seed=f"warmup-prefix-{seed}")
    low = _lowest_id(vocab_size)
    if decoy[0] == prefix[0] and vocab_size - low > 1:
        # A cache matches from the first token on: one differing token rules out any hit.
        decoy[0] = low + (prefix[0] - low + 1) % (vocab_size - low)
    return (
        [BenchRequest(decoy + r.prompt_token_ids, r.output_len) for r in warmups],
        [BenchRequest(prefix + r.prompt_token_ids, r.output_len) for r in measured],
    )
