"""Prometheus metrics of one server, in a registry of its own."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tandem.core import LLMEngine, RequestOutput

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class ServerMetrics:
    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        running = Gauge(
            "tandem:num_requests_running",
            "Requests in the running queue.",
            ["model_name"],
            registry=self.registry,
        )
        running.labels(**labels).set_function(lambda: engine.stats.num_running)
        waiting = Gauge(
            "tandem:num_requests_waiting",
            "Requests in the waiting queue.",
            ["model_name"],
            registry=self.registry,
        )
        waiting.labels(**labels).set_function(lambda: engine.stats.num_waiting)
        usage = Gauge(
            "tandem:kv_cache_usage_perc",
            "Fraction of KV-cache blocks in use (1 = full).",
            ["model_name"],
            registry=self.registry,
        )
        usage.labels(**labels).set_function(lambda: engine.stats.kv_cache_usage)
        slots = Gauge(
            "tandem:state_slot_usage_perc",
            "Fraction of linear-attention state slots in use (1 = full; 0 for models without "
            "linear attention).",
            ["model_name"],
            registry=self.registry,
        )
        slots.labels(**labels).set_function(lambda: engine.stats.state_slot_usage)
        # A gauge over the engine's own running count (vLLM: vllm:num_preemptions_total).
        preemptions = Gauge(
            "tandem:num_preemptions_total",
            "Sequences preempted (to be recomputed) since start.",
            ["model_name"],
            registry=self.registry,
        )
        preemptions.labels(**labels).set_function(lambda: engine.stats.num_preemptions)
        self._preparing = Gauge(
            "tandem:preparation_jobs_running",
            "Requests' slow preparation (parsing, rendering, tokenizing) running on the "
            "server's threads or in its preparation processes, including that of requests "
            "which timed out or went away.",
            ["model_name"],
            registry=self.registry,
        ).labels(**labels)
        self._prefix_cache(engine, labels)
        if engine.config.speculative is not None:
            self._spec_decode(engine, model_name)
        self._prompt_tokens = Counter(
            "tandem:prompt_tokens",
            "Prompt tokens of finished requests.",
            ["model_name"],
            registry=self.registry,
        ).labels(**labels)
        self._generation_tokens = Counter(
            "tandem:generation_tokens",
            "Generated tokens of finished requests.",
            ["model_name"],
            registry=self.registry,
        ).labels(**labels)
        self._success = Counter(
            "tandem:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._model = model_name
        self._ttft = Histogram(
            "tandem:time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        self._itl = Histogram(
            "tandem:inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request.",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        self._e2e = Histogram(
            "tandem:e2e_request_latency_seconds",
            "Time from arrival to the last output of a request.",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(**labels)

    def _prefix_cache(self, engine: LLMEngine, labels: dict[str, str]) -> None:
        """Prefix-cache lookups under vLLM's names (vllm:prefix_cache_queries and _hits, in
        prompt tokens), and for hybrid models the state snapshots behind their hits, as
        gauges over the engine's own running counts, like the preemptions."""
        counts = {
            "prefix_cache_queries": "Prompt tokens looked up in the prefix cache at admission.",
            "prefix_cache_hits": "Prompt tokens found in the prefix cache (not computed again).",
            "state_snapshot_queries": "Prefix-cache lookups of a hybrid model's linear-attention "
            "state snapshots.",
            "state_snapshot_hits": "Lookups that found a snapshot to start from.",
        }
        for name, doc in counts.items():
            gauge = Gauge(f"tandem:{name}_total", doc, ["model_name"], registry=self.registry)
            gauge.labels(**labels).set_function(_stat(engine, name))

    def _spec_decode(self, engine: LLMEngine, model_name: str) -> None:
        """Speculative decoding's counters under vLLM's names (vllm:spec_decode_*), as
        gauges over the engine's own running counts, like the preemptions."""
        assert engine.config.speculative is not None
        counts = {
            "num_drafts": "Verify rows run (one per sequence and step with drafts).",
            "num_draft_tokens": "Draft tokens proposed.",
            "num_accepted_tokens": "Draft tokens accepted.",
        }
        for name, doc in counts.items():
            gauge = Gauge(
                f"tandem:spec_decode_{name}_total", doc, ["model_name"], registry=self.registry
            )
            gauge.labels(model_name=model_name).set_function(_stat(engine, f"spec_{name}"))
        per_position = Gauge(
            "tandem:spec_decode_num_accepted_tokens_per_pos_total",
            "Draft tokens accepted at each draft position (0 = the first draft).",
            ["model_name", "position"],
            registry=self.registry,
        )
        for position in range(engine.config.speculative.num_speculative_tokens):
            per_position.labels(model_name=model_name, position=str(position)).set_function(
                _accepted_at(engine, position)
            )

    def count_preparation(self, jobs_running: Callable[[], float]) -> None:
        self._preparing.set_function(jobs_running)

    def observe_inter_token(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def observe_finished(self, out: RequestOutput) -> None:
        self._prompt_tokens.inc(len(out.prompt_token_ids))
        self._generation_tokens.inc(len(out.token_ids))
        self._success.labels(model_name=self._model, finished_reason=out.finish_reason).inc()
        m = out.metrics
        if m is None:
            return
        if m.first_token_time is not None:
            self._ttft.observe(m.first_token_time - m.arrival_time)
        if m.finished_time is not None:
            self._e2e.observe(m.finished_time - m.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _accepted_at(engine: LLMEngine, position: int) -> Callable[[], float]:
    def read() -> float:
        counts = engine.stats.spec_accepted_per_position
        return float(counts[position]) if position < len(counts) else 0.0

    return read


def _stat(engine: LLMEngine, name: str) -> Callable[[], float]:
    """The engine's current count ``name`` (read from its latest stats snapshot)."""
    return lambda: float(getattr(engine.stats, name))
