"""Aggregate request results into vLLM's serving-benchmark figures and table."""

from __future__ import annotations

import statistics
from typing import Any

from tandem.server.bench.client import RequestResult


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _summary(name: str, values_s: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    return {
        f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
        f"median_{name}_ms": statistics.median(ms) if ms else 0.0,
        f"p99_{name}_ms": _percentile(ms, 99),
    }


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    # As vLLM defines it: decode time per token after the first.
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    figures: dict[str, Any] = {
        "completed": len(ok),
        "num_prompts": len(results),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    figures |= _summary("ttft", [r.ttft for r in ok])
    figures |= _summary("tpot", tpots)
    figures |= _summary("itl", [gap for r in ok for gap in r.itl])
    figures |= _summary("e2el", [r.latency for r in ok])
    figures |= _turn_ttfts(ok)
    figures["errors"] = sorted({r.error for r in results if r.error})[:5]
    return figures


def _turn_ttfts(ok: list[RequestResult]) -> dict[str, float | None]:
    """Mean TTFT of first turns and of later ones, whose prompts open with all the
    conversation before them (what a prefix cache can serve); None outside a multi-turn
    run, or where no such turn succeeded."""
    first = [r.ttft * 1000 for r in ok if r.turn == 1]
    later = [r.ttft * 1000 for r in ok if r.turn is not None and r.turn > 1]
    return {
        "mean_ttft_first_turn_ms": statistics.fmean(first) if first else None,
        "mean_ttft_later_turns_ms": statistics.fmean(later) if later else None,
    }


def format_table(f: dict[str, Any]) -> str:
    lines = [
        "{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="),
        f"{'Successful requests:':<40}{f['completed']:<10}",
        f"{'Failed requests:':<40}{f['failed']:<10}",
        f"{'Benchmark duration (s):':<40}{f['duration_s']:<10.2f}",
        f"{'Total input tokens:':<40}{f['total_input_tokens']:<10}",
        f"{'Total generated tokens:':<40}{f['total_output_tokens']:<10}",
        f"{'Request throughput (req/s):':<40}{f['request_throughput']:<10.2f}",
        f"{'Output token throughput (tok/s):':<40}{f['output_throughput']:<10.2f}",
        f"{'Total token throughput (tok/s):':<40}{f['total_token_throughput']:<10.2f}",
    ]
    titles = {
        "ttft": "Time to First Token",
        "tpot": "Time per Output Token (excl. 1st token)",
        "itl": "Inter-token Latency",
        "e2el": "End-to-end Latency",
    }
    for key, title in titles.items():
        lines.append("{s:{c}^50}".format(s=f" {title} ", c="-"))
        upper = key.upper()
        lines.append(f"{f'Mean {upper} (ms):':<40}{f[f'mean_{key}_ms']:<10.2f}")
        lines.append(f"{f'Median {upper} (ms):':<40}{f[f'median_{key}_ms']:<10.2f}")
        lines.append(f"{f'P99 {upper} (ms):':<40}{f[f'p99_{key}_ms']:<10.2f}")
        if key == "ttft":
            # Beside TTFT, which the cache is there to cut.
            lines.extend(_cache_lines(f))
    lines.append("=" * 50)
    return "\n".join(lines)


def _cache_lines(f: dict[str, Any]) -> list[str]:
    lines = []
    if f.get("turns", 1) > 1:
        lines.append(f"{'Turns per conversation:':<40}{f['turns']:<10}")
        for label, key in (("turn 1", "first_turn"), ("later turns", "later_turns")):
            mean = f.get(f"mean_ttft_{key}_ms")
            shown = "n/a" if mean is None else f"{mean:<10.2f}"
            lines.append(f"{f'Mean TTFT, {label} (ms):':<40}{shown}")
    if f.get("shared_prefix_len"):
        lines.append(f"{'Shared prefix (tokens):':<40}{f['shared_prefix_len']:<10}")
    queries, hits = f.get("prefix_cache_queries"), f.get("prefix_cache_hits")
    if queries is None or hits is None:
        rate = "n/a"
    elif queries == 0:
        rate = "n/a (no prompt tokens looked up)"
    else:
        rate = f"{100 * hits / queries:.2f}% ({hits} of {queries} prompt tokens)"
    lines.append(f"{'Prefix cache hit rate:':<40}{rate}")
    snapshot_queries, snapshot_hits = f.get("state_snapshot_queries"), f.get("state_snapshot_hits")
    if snapshot_queries is not None and snapshot_hits is not None:
        lines.append(f"{'State snapshots:':<40}{snapshot_hits} of {snapshot_queries} lookups hit")
    return lines
