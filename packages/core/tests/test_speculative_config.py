"""--speculative-config: vLLM's JSON keys and defaults, range checks, clear refusals."""

from __future__ import annotations

import pytest

from tandem.core.config import SpeculativeConfig
from tandem.core.errors import ConfigError


def test_vllm_keys_map_onto_the_config() -> None:
    config = SpeculativeConfig.from_json(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 6, '
        '"prompt_lookup_min": 2}'
    )
    assert config == SpeculativeConfig("ngram", 4, prompt_lookup_max=6, prompt_lookup_min=2)


@pytest.mark.parametrize(
    ("extra", "bounds"),
    [("", (5, 5)), (', "prompt_lookup_max": 3', (3, 3)), (', "prompt_lookup_min": 2', (2, 2))],
)
def test_a_missing_lookup_bound_takes_vllms_default(extra: str, bounds: tuple[int, int]) -> None:
    config = SpeculativeConfig.from_json(
        f'{{"method": "ngram", "num_speculative_tokens": 2{extra}}}'
    )
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == bounds


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("{", "is not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"method": "ngram"}', "needs method and num_speculative_tokens"),
        ('{"method": "eagle", "num_speculative_tokens": 1}', "'eagle' (not served yet) is not"),
        ('{"method": "lookahead", "num_speculative_tokens": 1}', "supported: 'ngram', 'mtp'"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "must be in [1, 64], got 0"),
        ('{"method": "ngram", "num_speculative_tokens": 65}', "must be in [1, 64], got 65"),
        ('{"method": "ngram", "num_speculative_tokens": "3"}', "must be an integer"),
        ('{"method": "ngram", "num_speculative_tokens": true}', "must be an integer"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}', ">= 1"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
            '"prompt_lookup_max": 3}',
            "prompt_lookup_min (4) must be <= prompt_lookup_max (3)",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "unsupported key"),
    ],
)
def test_bad_configs_are_refused_with_what_to_do(text: str, expected: str) -> None:
    with pytest.raises(ConfigError, match="--speculative-config") as info:
        SpeculativeConfig.from_json(text)
    assert expected in str(info.value)
