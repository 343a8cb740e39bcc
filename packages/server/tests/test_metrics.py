"""/metrics: speculative decoding's counters under vLLM's names, only when it is on."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tandem.core import CacheConfig, EngineConfig, LLMEngine, ModelLoadConfig, SamplingParams
from tandem.core.config import SpeculativeConfig
from tandem.core.demo.pretrained import stories260k_folder
from tandem.server.metrics import ServerMetrics

SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)


def _samples(metrics: ServerMetrics) -> dict[tuple[str, str], float]:
    text = metrics.render().decode()
    return {
        (s.name, s.labels.get("position", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _engine(speculative: SpeculativeConfig | None) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelLoadConfig(model=str(stories260k_folder())),
            cache=CacheConfig(num_blocks=64),
            speculative=speculative,
        )
    )


def test_spec_decode_counters_report_the_engines_figures() -> None:
    engine = _engine(SPEC)
    try:
        metrics = ServerMetrics(engine, "m")
        prompt = "Tom had a red ball. Tom had a red ball. Tom had a red"
        engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0))
        stats = engine.stats
        samples = _samples(metrics)
    finally:
        engine.shutdown()
    assert stats.spec_num_accepted_tokens > 0
    assert samples[("tandem:spec_decode_num_drafts_total", "")] == stats.spec_num_drafts
    assert samples[("tandem:spec_decode_num_draft_tokens_total", "")] == (
        stats.spec_num_draft_tokens
    )
    assert samples[("tandem:spec_decode_num_accepted_tokens_total", "")] == (
        stats.spec_num_accepted_tokens
    )
    per_position = [
        samples[("tandem:spec_decode_num_accepted_tokens_per_pos_total", str(p))] for p in range(3)
    ]
    assert per_position == list(stats.spec_accepted_per_position)


def test_without_speculation_there_are_no_spec_decode_metrics() -> None:
    engine = _engine(None)
    try:
        names = {name for name, _ in _samples(ServerMetrics(engine, "m"))}
    finally:
        engine.shutdown()
    assert not any("spec_decode" in name for name in names)
