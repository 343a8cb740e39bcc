"""The benchmark's figures follow vLLM's definitions."""

from __future__ import annotations

import pytest

from tandem.server.bench.client import RequestResult
from tandem.server.bench.dataset import random_requests
from tandem.server.bench.report import format_table, summarize


def test_tpot_ttft_itl_and_throughput() -> None:
    results = [
        RequestResult(
            success=True,
            prompt_tokens=10,
            output_tokens=5,
            ttft=0.1,
            latency=0.5,
            itl=[0.1, 0.1, 0.1, 0.1],
        ),
        RequestResult(
            success=True, prompt_tokens=10, output_tokens=3, ttft=0.3, latency=0.7, itl=[0.2, 0.2]
        ),
        RequestResult(success=False, prompt_tokens=10, error="HTTP 500"),
    ]
    f = summarize(results, duration=2.0)
    assert (f["completed"], f["failed"]) == (2, 1)
    assert f["total_output_tokens"] == 8 and f["total_input_tokens"] == 20
    assert f["output_throughput"] == pytest.approx(4.0)
    assert f["total_token_throughput"] == pytest.approx(14.0)
    # TPOT = (latency - TTFT) / (output - 1): 100 ms and 200 ms.
    assert f["mean_tpot_ms"] == pytest.approx(150.0)
    assert f["mean_ttft_ms"] == pytest.approx(200.0)
    assert f["median_itl_ms"] == pytest.approx(100.0)
    assert f["p99_e2el_ms"] == pytest.approx(698.0)
    assert f["errors"] == ["HTTP 500"]
    table = format_table(f)
    assert "Successful requests:" in table and "Mean TPOT (ms):" in table


def test_random_requests_lengths() -> None:
    fixed = random_requests(4, input_len=20, output_len=7, range_ratio=0.0, vocab_size=100, seed=1)
    assert all(len(r.prompt_token_ids) == 20 and r.output_len == 7 for r in fixed)
    assert all(16 <= t < 100 for r in fixed for t in r.prompt_token_ids)
    ranged = random_requests(
        200, input_len=100, output_len=10, range_ratio=0.5, vocab_size=100, seed=2
    )
    lengths = [len(r.prompt_token_ids) for r in ranged]
    assert min(lengths) >= 50 and max(lengths) <= 150 and len(set(lengths)) > 10
    again = random_requests(
        200, input_len=100, output_len=10, range_ratio=0.5, vocab_size=100, seed=2
    )
    assert again == ranged
    with pytest.raises(ValueError):
        random_requests(1, 10, 10, range_ratio=1.5, vocab_size=100, seed=0)


def test_repeated_prompts_say_one_segment_over_and_over() -> None:
    plain = random_requests(3, input_len=22, output_len=5, range_ratio=0.0, vocab_size=90, seed=4)
    repeated = random_requests(
        3, input_len=22, output_len=5, range_ratio=0.0, vocab_size=90, seed=4, repeats=4
    )
    # Repeats of 1 are the plain prompts; 4 repeats of a 6-token segment, cut to 22 tokens.
    assert random_requests(3, 22, 5, 0.0, vocab_size=90, seed=4, repeats=1) == plain
    for r in repeated:
        segment = r.prompt_token_ids[:6]
        assert len(r.prompt_token_ids) == 22 and r.prompt_token_ids == (segment * 4)[:22]
    with pytest.raises(ValueError, match="--prompt-repeats"):
        random_requests(1, 10, 10, 0.0, vocab_size=100, seed=0, repeats=0)
