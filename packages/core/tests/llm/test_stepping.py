"""The stepping mode is picked once, from the config."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.core.config import ParallelConfig, PipelineConfig
from tandem.core.errors import ConfigError
from tandem.core.llm.pipelined_stepping import PipelinedStepping
from tandem.core.llm.sampling_params import SamplingParams
from tandem.core.llm.stepping import LaunchAheadStepping, SerialStepping

from ..conftest import EngineFactory, engine_config


@pytest.mark.parametrize(
    ("pipeline", "mode"),
    [
        (PipelineConfig(), SerialStepping),
        (PipelineConfig(overlap_steps=False), SerialStepping),
        (PipelineConfig(overlap_steps=True), LaunchAheadStepping),
        (PipelineConfig(max_concurrency=2), PipelinedStepping),
        (PipelineConfig(max_concurrency=2, overlap_steps=True), PipelinedStepping),
    ],
)
def test_the_mode_follows_the_config_and_every_mode_generates_alike(
    demo_dir: Path, make_engine: EngineFactory, pipeline: PipelineConfig, mode: type
) -> None:
    engine = make_engine(demo_dir, pipeline=pipeline)
    assert type(engine.stepper) is mode
    [out] = engine.generate(["hello world"], SamplingParams.greedy(max_tokens=6))
    assert out.finish_reason == "length" and len(out.token_ids) == 6


def test_bad_devices_are_refused_before_any_worker_starts(demo_dir: Path) -> None:
    from tandem.core.llm.engine import LLMEngine

    config = engine_config(demo_dir, parallel=ParallelConfig(devices="tpu:0"))
    with pytest.raises(ConfigError, match="--devices"):
        LLMEngine(config)
