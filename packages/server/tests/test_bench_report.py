"""The benchmark's figures follow vLLM's definitions."""

from __future__ import annotations

import pytest

from tandem.server.bench.client import RequestResult
from tandem.server.bench.dataset import BenchRequest, random_requests, split_warmups
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


def _split(
    num_warmups: int,
    num_prompts: int,
    seed: int,
    shared_prefix_len: int = 0,
    repeats: int = 1,
    vocab_size: int = 100,
) -> tuple[list[BenchRequest], list[BenchRequest]]:
    requests = random_requests(
        num_warmups + num_prompts,
        input_len=10,
        output_len=5,
        range_ratio=0.3,
        vocab_size=vocab_size,
        seed=seed,
        repeats=repeats,
    )
    return split_warmups(
        requests, num_warmups, shared_prefix_len=shared_prefix_len, vocab_size=vocab_size, seed=seed
    )


def _plain(num: int, seed: int, repeats: int = 1) -> list[BenchRequest]:
    return random_requests(
        num, input_len=10, output_len=5, range_ratio=0.3, vocab_size=100, seed=seed, repeats=repeats
    )


def test_shared_prefix_opens_every_measured_prompt_and_no_warmup() -> None:
    warmups, measured = _split(num_warmups=3, num_prompts=6, seed=7, shared_prefix_len=24)
    plain = _plain(9, seed=7)
    assert len(warmups) == 3 and len(measured) == 6
    prefix = measured[0].prompt_token_ids[:24]
    assert all(16 <= t < 100 for t in prefix) and len(set(prefix)) > 5
    for request, own in zip(measured, plain[3:], strict=True):
        # The prefix, then the very request the random mode makes without one.
        assert request.prompt_token_ids == prefix + own.prompt_token_ids
        assert request.output_len == own.output_len
    parts = [tuple(r.prompt_token_ids[24:]) for r in measured]
    assert len(set(parts)) == 6 and len({len(p) for p in parts}) > 1
    assert all(7 <= len(p) <= 13 for p in parts)
    # Warm-ups keep the shape (a prefix as long) but share no first token with the measured
    # prefix, so nothing they leave in the cache can serve it.
    decoy = warmups[0].prompt_token_ids[:24]
    for request, own in zip(warmups, plain[:3], strict=True):
        assert request.prompt_token_ids == decoy + own.prompt_token_ids
    assert decoy[0] != prefix[0]
    # The prefix follows --seed.
    assert _split(num_warmups=3, num_prompts=6, seed=7, shared_prefix_len=24) == (
        warmups,
        measured,
    )
    _, other = _split(num_warmups=0, num_prompts=1, seed=8, shared_prefix_len=24)
    assert other[0].prompt_token_ids[:24] != prefix


def test_shared_prefix_edge_cases() -> None:
    # Without a prefix, the split of the plain random requests.
    assert _split(num_warmups=2, num_prompts=3, seed=4) == (
        _plain(5, seed=4)[:2],
        _plain(5, seed=4)[2:],
    )
    # Repeats say the request's own part over and over, never the prefix.
    _, repeated = _split(num_warmups=0, num_prompts=3, seed=4, shared_prefix_len=5, repeats=2)
    for request, own in zip(repeated, _plain(3, seed=4, repeats=2), strict=True):
        tokens = own.prompt_token_ids
        assert request.prompt_token_ids[5:] == tokens
        assert tokens == (tokens[: -(-len(tokens) // 2)] * 2)[: len(tokens)]
    # Even where the vocabulary makes a first-token clash likely, the warm-ups differ there.
    for seed in range(40):
        w, m = _split(num_warmups=1, num_prompts=1, seed=seed, shared_prefix_len=3, vocab_size=18)
        assert w[0].prompt_token_ids[0] != m[0].prompt_token_ids[0]
    with pytest.raises(ValueError, match="--shared-prefix-len"):
        _split(num_warmups=0, num_prompts=1, seed=0, shared_prefix_len=-1)


def test_the_cache_figures_sit_beside_ttft() -> None:
    f = summarize([RequestResult(success=True, output_tokens=2, ttft=0.1, latency=0.2)], 1.0)
    f |= {
        "shared_prefix_len": 512,
        "prefix_cache_queries": 2048,
        "prefix_cache_hits": 1536,
        "prefix_cache_hit_rate": 0.75,
        "state_snapshot_queries": 4,
        "state_snapshot_hits": 3,
    }
    lines = format_table(f).splitlines()
    at = lines.index(next(line for line in lines if line.startswith("P99 TTFT")))
    assert lines[at + 1].split() == ["Shared", "prefix", "(tokens):", "512"]
    assert lines[at + 2].endswith("75.00% (1536 of 2048 prompt tokens)")
    assert lines[at + 2].startswith("Prefix cache hit rate:")
    assert lines[at + 3].endswith("3 of 4 lookups hit") and "Time per Output" in lines[at + 4]
    unknown = format_table(summarize([], 1.0) | {"prefix_cache_queries": None})
    assert "Prefix cache hit rate:                  n/a\n" in unknown
    assert "State snapshots" not in unknown and "Shared prefix" not in unknown
