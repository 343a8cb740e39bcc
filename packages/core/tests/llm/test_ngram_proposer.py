"""The n-gram proposer: the longest suffix n-gram seen before, earliest on ties, and the
tokens that followed it."""

from __future__ import annotations

import random

from tandem.core.config import SpeculativeConfig
from tandem.core.llm.ngram_proposer import NgramProposer


def _proposer(k: int, low: int, high: int) -> NgramProposer:
    return NgramProposer(
        SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=low, prompt_lookup_max=high)
    )


def _reference(tokens: list[int], k: int, low: int, high: int) -> list[int]:
    """The rule spelt out token by token: for n from high down to low, the earliest earlier
    occurrence of the last n tokens, and up to k tokens after it."""
    for n in range(high, low - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_the_example_of_vllms_docstring() -> None:
    # [4, 2, 3] never occurred before; [2, 3] did, followed by 4, 2, 3 (only three tokens).
    assert _proposer(4, 2, 3).propose([1, 2, 3, 4, 2, 3], max_drafts=10) == [4, 2, 3]


def test_the_longest_match_wins_over_a_later_shorter_one() -> None:
    tokens = [7, 8, 9, 1, 5, 9, 1, 2, 7, 8, 9, 1]
    # [9, 1] also follows 8 at 2..3 and 5 at 5..6; the 4-gram [7, 8, 9, 1] is at 0..3.
    assert _proposer(2, 1, 4).propose(tokens, max_drafts=10) == [5, 9]


def test_equally_long_matches_take_the_earliest() -> None:
    assert _proposer(1, 1, 1).propose([3, 4, 3, 6, 3], max_drafts=10) == [4]


def test_no_match_shorter_than_the_minimum_and_the_caps() -> None:
    proposer = _proposer(3, 2, 2)
    assert proposer.propose([1, 2, 3, 2], max_drafts=10) == []  # only a 1-gram repeats
    assert proposer.propose([1, 2, 3, 1, 2], max_drafts=10) == [3, 1, 2]
    assert proposer.propose([1, 2, 3, 1, 2], max_drafts=1) == [3]
    assert proposer.propose([1, 2, 3, 1, 2], max_drafts=0) == []
    assert proposer.propose([1, 2], max_drafts=10) == []


def test_it_agrees_with_the_rule_on_random_sequences() -> None:
    rng = random.Random(5)
    for _ in range(400):
        low = rng.randint(1, 3)
        high = rng.randint(low, 5)
        k = rng.randint(1, 5)
        tokens = [rng.randint(0, 3) for _ in range(rng.randint(1, 40))]
        got = _proposer(k, low, high).propose(tokens, max_drafts=10)
        assert got == _reference(tokens, k, low, high), (tokens, k, low, high)
