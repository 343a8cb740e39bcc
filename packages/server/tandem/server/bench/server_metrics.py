"""The server's cache counters, read from its Prometheus ``/metrics`` before and after a
run: how many prompt tokens the prefix cache was asked for and how many it had, and, for
hybrid models, how many per-sequence state snapshots were looked up and found."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

# Tandem's names first; vLLM's CPU build, the peer the benchmark also runs against, second.
PREFIX_CACHE_COUNTERS = (
    ("tandem:prefix_cache_queries_total", "tandem:prefix_cache_hits_total"),
    ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
)
STATE_SNAPSHOT_COUNTERS = (
    "tandem:state_snapshot_queries_total",
    "tandem:state_snapshot_hits_total",
)


@dataclass(frozen=True)
class CacheCounters:
    """Totals summed over label sets; None where the server does not expose the counter."""

    prefix_queries: float | None = None
    prefix_hits: float | None = None
    snapshot_queries: float | None = None
    snapshot_hits: float | None = None


def parse_cache_counters(text: str) -> CacheCounters:
    """The counters in Prometheus exposition ``text``; all None when it is not parseable."""
    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    # The parser's own errors for a malformed page (IndexError on some truncated lines).
    except (ValueError, IndexError):
        return CacheCounters()
    prefix_queries = prefix_hits = None
    for queries_name, hits_name in PREFIX_CACHE_COUNTERS:
        if queries_name in totals and hits_name in totals:
            prefix_queries, prefix_hits = totals[queries_name], totals[hits_name]
            break
    snapshot_queries, snapshot_hits = (totals.get(name) for name in STATE_SNAPSHOT_COUNTERS)
    return CacheCounters(prefix_queries, prefix_hits, snapshot_queries, snapshot_hits)


async def fetch_cache_counters(
    session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]
) -> CacheCounters:
    """The counters at ``base_url``/metrics now; all None when the server has no such page
    or cannot be read (the benchmark's own figures do not depend on it)."""
    try:
        async with session.get(
            f"{base_url}/metrics", headers=headers, timeout=aiohttp.ClientTimeout(total=30.0)
        ) as response:
            if response.status != 200:
                return CacheCounters()
            text = await response.text()
    # LookupError: a charset the page names that Python does not know.
    except (aiohttp.ClientError, asyncio.TimeoutError, UnicodeDecodeError, LookupError):
        return CacheCounters()
    return parse_cache_counters(text)


def _delta(before: float | None, after: float | None) -> int | None:
    if before is None or after is None or not math.isfinite(after - before):
        return None
    # A counter that went down was reset (a server restart): the run's share is unknown.
    return round(after - before) if after >= before else None


def _pair(
    queries: tuple[float | None, float | None], hits: tuple[float | None, float | None]
) -> tuple[int | None, int | None]:
    """Run deltas of a (queries, hits) pair from their (before, after) values; a hit count
    without its query count says nothing, so both are known or neither."""
    dq, dh = _delta(*queries), _delta(*hits)
    return (dq, dh) if dq is not None and dh is not None else (None, None)


def cache_figures(before: CacheCounters, after: CacheCounters) -> dict[str, Any]:
    """What the run added to the counters, as ``--result-json`` keys (None: unknown)."""
    queries, hits = _pair(
        (before.prefix_queries, after.prefix_queries), (before.prefix_hits, after.prefix_hits)
    )
    snapshot_queries, snapshot_hits = _pair(
        (before.snapshot_queries, after.snapshot_queries),
        (before.snapshot_hits, after.snapshot_hits),
    )
    return {
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if hits is not None and queries else None,
        "state_snapshot_queries": snapshot_queries,
        "state_snapshot_hits": snapshot_hits,
    }
