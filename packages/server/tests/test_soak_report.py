"""The soak's verdict: what fails it (errors, malformed requests accepted, a server not back at
rest, memory that grows between the middle and the end, an unclean exit)."""

from __future__ import annotations

from collections import Counter

from tandem.server.bench.soak import SoakReport, format_report, summarize_trace
from tandem.server.bench.soak_server import Sample


def _report(**changes: object) -> SoakReport:
    report = SoakReport("llm", "tp1", 60, 8)
    report.outcomes = Counter(ok=50, disconnected=10, rejected=3, overloaded=4)
    report.latencies_s = [0.1 * i for i in range(1, 51)]
    report.samples = {m: Sample(400.0, 12, 1) for m in ("start", "middle", "end")}
    report.rest = {"tandem:num_requests_running": 0.0, "tandem:kv_cache_usage_perc": 0.0}
    report.exit_status = 0
    for name, value in changes.items():
        setattr(report, name, value)
    return report


def test_a_clean_run_passes_and_prints_every_figure() -> None:
    report = _report()
    assert report.problems() == []
    text = format_report(report)
    for figure in ("ok:", "disconnected:", "overloaded:", "p50 / p99", "RSS / threads at start",
                   "RSS growth middle -> end:         +0.00%", "running 0, waiting 0",
                   "Verdict:                          PASS"):  # fmt: skip
        assert figure in text, figure


def test_each_problem_fails_the_run() -> None:
    growing = {m: Sample(400.0 if m != "end" else 421.0, 12, 1) for m in ("start", "middle", "end")}
    cases = [
        (_report(outcomes=Counter(ok=5, error=1)), "1 errors"),
        (_report(outcomes=Counter(ok=5, malformed_accepted=2)), "malformed requests accepted"),
        (_report(rest={"tandem:kv_cache_usage_perc": 0.25}), "kv_cache_usage_perc = 0.25"),
        (_report(samples=growing), "RSS grew 5.2%"),
        (_report(exit_status=3), "exited with status 3"),
        (_report(outcomes=Counter(overloaded=5)), "no request succeeded"),
    ]
    for report, problem in cases:
        assert any(problem in p for p in report.problems()), (problem, report.problems())
        assert "FAIL" in format_report(report)


def test_memory_is_read_as_medians_so_a_spike_is_not_a_trend() -> None:
    flat = [(float(t), Sample(400.0, 12, 1)) for t in range(101)]
    spiky = [(t, Sample(480.0, 12, 1)) if t in (50.0, 99.0) else (t, s) for t, s in flat]
    samples = summarize_trace(spiky, duration_s=100)
    assert samples["middle"].rss_mib == samples["end"].rss_mib == 400.0
    growing = [(t, Sample(400.0 + t, 12 + int(t > 90), 1)) for t, _ in flat]
    samples = summarize_trace(growing, duration_s=100)
    assert samples["start"].rss_mib == 415.0
    assert samples["middle"].rss_mib == 450.0 and samples["end"].rss_mib == 495.0
    assert samples["end"].threads == 13
