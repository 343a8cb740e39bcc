"""``tandem bench soak``: a real server under a bounded stretch of mixed, adversarial load.

It starts ``tandem serve`` itself (to watch its memory, threads and exit), keeps up to
``concurrency`` requests in flight for ``duration`` seconds (see ``soak_workload``), then
checks that the server comes back to rest (nothing running or waiting, no KV block held),
that its memory did not grow between the middle and the end of the run, and that it stops
cleanly; and prints the figures."""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tandem.server.bench.soak_server import REST_GAUGES, Sample, SoakServer
from tandem.server.bench.soak_workload import OUTCOMES, LLMWorkload, Mix, RecWorkload, Result

# Growth of the server's RSS from the middle of the run to its end that fails the soak.
MAX_RSS_GROWTH = 0.05
# What the server's Retry-After says when it is overloaded.
RETRY_AFTER_S = 1.0
# How often the server's memory and threads are read, and the share of the run around each
# moment (start, middle, end) whose median stands for it: single readings catch the spikes
# of one large batch, not a trend.
SAMPLE_EVERY_S = 1.0
WINDOW = 0.1


def summarize_trace(trace: list[tuple[float, Sample]], duration_s: float) -> dict[str, Sample]:
    """The median RSS (and the most threads) in a window at the start (after the first
    tenth, the warm-up), around the middle and at the end of the run."""
    width = max(WINDOW * duration_s, SAMPLE_EVERY_S)
    windows = {
        "start": (width, 2 * width),
        "middle": (duration_s / 2 - width / 2, duration_s / 2 + width / 2),
        "end": (duration_s - width, float("inf")),
    }
    samples = {}
    for moment, (low, high) in windows.items():
        chosen = [s for t, s in trace if low <= t <= high] or [trace[-1][1]]
        samples[moment] = Sample(
            statistics.median(s.rss_mib for s in chosen),
            max(s.threads for s in chosen),
            max(s.processes for s in chosen),
        )
    return samples


@dataclass(frozen=True)
class SoakConfig:
    model: Path
    topology: str
    duration_s: float
    concurrency: int
    mix: Mix
    server_args: list[str]
    seed: int


@dataclass
class SoakReport:
    kind: str
    topology: str
    duration_s: float
    concurrency: int
    outcomes: Counter[str] = field(default_factory=Counter)
    latencies_s: list[float] = field(default_factory=list)
    samples: dict[str, Sample] = field(default_factory=dict)
    peak_rss_mib: float = 0.0
    rest: dict[str, float] = field(default_factory=dict)
    exit_status: int | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def rss_growth(self) -> float:
        middle, end = self.samples["middle"].rss_mib, self.samples["end"].rss_mib
        return (end - middle) / middle if middle else 0.0

    def problems(self) -> list[str]:
        found = []
        if self.outcomes["error"] or self.outcomes["transport_error"]:
            found.append(
                f"{self.outcomes['error']} errors, {self.outcomes['transport_error']} transport "
                "errors"
            )
        if self.outcomes["malformed_accepted"]:
            found.append(f"{self.outcomes['malformed_accepted']} malformed requests accepted")
        if not self.outcomes["ok"]:
            found.append("no request succeeded")
        for name in REST_GAUGES:
            if self.rest.get(name, 0.0):
                found.append(f"{name} = {self.rest[name]} after the load")
        if self.rss_growth >= MAX_RSS_GROWTH:
            found.append(f"RSS grew {100 * self.rss_growth:.1f}% from the middle to the end")
        if self.exit_status != 0:
            found.append(f"the server exited with status {self.exit_status}")
        return found


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def format_report(report: SoakReport) -> str:
    total = sum(report.outcomes.values())
    lines = [
        "{s:{c}^64}".format(s=" Soak Result ", c="="),
        f"{'Kind / topology:':<34}{report.kind} / {report.topology}",
        f"{'Duration (s) / concurrency:':<34}{report.duration_s:.0f} / {report.concurrency}",
        f"{'Requests:':<34}{total} ({total / report.duration_s:.1f}/s)",
    ]
    for outcome in OUTCOMES:
        lines.append(f"{'  ' + outcome + ':':<34}{report.outcomes[outcome]}")
    ms = [1000 * s for s in report.latencies_s]
    lines.append(f"{'Latency of ok requests p50 / p99:':<34}{_percentile(ms, 50):.0f} / "
                 f"{_percentile(ms, 99):.0f} ms")  # fmt: skip
    for moment in ("start", "middle", "end"):
        sample = report.samples.get(moment)
        if sample is not None:
            lines.append(f"{'RSS / threads at ' + moment + ':':<34}{sample.rss_mib:.0f} MiB / "
                         f"{sample.threads} threads, {sample.processes} processes")  # fmt: skip
    if "middle" in report.samples and "end" in report.samples:
        lines.append(f"{'RSS growth middle -> end:':<34}{100 * report.rss_growth:+.2f}%")
        lines.append(f"{'Peak RSS:':<34}{report.peak_rss_mib:.0f} MiB")
    rest = report.rest
    lines.append(
        f"{'After the load:':<34}running {rest.get('tandem:num_requests_running', 0):.0f}, "
        f"waiting {rest.get('tandem:num_requests_waiting', 0):.0f}, KV usage "
        f"{rest.get('tandem:kv_cache_usage_perc', 0):.3f}"
    )
    if "tandem:num_preemptions_total" in rest:
        lines.append(f"{'Preemptions:':<34}{rest['tandem:num_preemptions_total']:.0f}")
    lines.append(f"{'Server exit status:':<34}{report.exit_status}")
    problems = report.problems()
    lines.append(f"{'Verdict:':<34}{'PASS' if not problems else 'FAIL: ' + '; '.join(problems)}")
    for error in report.errors[:5]:
        lines.append(f"  e.g. {error}")
    lines.append("=" * 64)
    return "\n".join(lines)


async def _load(server: SoakServer, config: SoakConfig, report: SoakReport) -> None:
    # Idle connections are dropped well before the server's keep-alive timeout (5 s), so a
    # request never goes out on one the server is closing at that moment.
    limits = httpx.Limits(max_connections=config.concurrency + 8, keepalive_expiry=2.0)
    timeout = httpx.Timeout(connect=10.0, read=300.0, write=30.0, pool=300.0)
    async with httpx.AsyncClient(
        base_url=server.base_url, limits=limits, timeout=timeout
    ) as client:
        card: dict[str, Any] = (await client.get("/v1/models")).json()["data"][0]
        workload: LLMWorkload | RecWorkload
        if card.get("kind") == "generative-recommender":
            report.kind = "recommender"
            workload = RecWorkload(client, card["id"], card, config.mix)
        else:
            workload = LLMWorkload(client, card["id"], int(card["vocab_size"]), config.mix)
        started = time.monotonic()
        end = started + config.duration_s

        async def worker(index: int) -> None:
            rng = random.Random(config.seed * 1_000_003 + index)
            while time.monotonic() < end:
                result: Result = await workload.one(rng)
                report.outcomes[result.outcome] += 1
                if result.outcome == "ok":
                    report.latencies_s.append(result.latency_s)
                elif result.outcome == "overloaded":
                    # As a well-behaved client does: wait what Retry-After says (1 s).
                    await asyncio.sleep(RETRY_AFTER_S)
                elif result.outcome in ("error", "transport_error", "malformed_accepted"):
                    report.errors.append(f"{result.outcome}: {result.detail}")

        trace: list[tuple[float, Sample]] = []

        async def watch() -> None:
            while True:
                trace.append((time.monotonic() - started, server.sample()))
                await asyncio.sleep(SAMPLE_EVERY_S)

        watcher = asyncio.create_task(watch())
        await asyncio.gather(*(worker(i) for i in range(config.concurrency)))
        trace.append((time.monotonic() - started, server.sample()))
        watcher.cancel()
        report.samples = summarize_trace(trace, config.duration_s)
        report.peak_rss_mib = max(sample.rss_mib for _, sample in trace)


def run_soak(config: SoakConfig) -> SoakReport:
    log = Path(tempfile.mkdtemp(prefix="tandem-soak-")) / "server.log"
    report = SoakReport("llm", config.topology, config.duration_s, config.concurrency)
    server = SoakServer(config.model, config.topology, config.server_args, log)
    try:
        server.wait_ready()
        asyncio.run(_load(server, config, report))
        report.rest = server.wait_idle(timeout=60)
    finally:
        report.exit_status = server.stop()
    if report.problems():
        report.errors.append(f"server log: {log}")
    return report
