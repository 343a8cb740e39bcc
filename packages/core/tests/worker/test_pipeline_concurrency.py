"""Several steps in flight on a worker's pipeline lanes (``--max-concurrency``) give the same
tokens as one step at a time, at TP=1 and TP=2 in one process, and free every block."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.core import LLMEngine, SamplingParams
from tandem.core.config import ParallelConfig, PipelineConfig
from tandem.core.errors import ConfigError
from tandem.core.executor.thread_executor import ThreadExecutor

from ..conftest import EngineFactory

PROMPTS = [[1 + i, 45, 300, 21 + i] * (1 + i % 3) for i in range(10)]


def _run(engine: LLMEngine, params: list[SamplingParams]) -> list[list[int]]:
    outs = engine.generate(PROMPTS, params)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [o.token_ids for o in outs]


def _params() -> list[SamplingParams]:
    # Greedy rows and seeded sampled rows: both must not depend on what else is in flight.
    return [
        SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0)
        if i % 2
        else SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, seed=100 + i)
        for i in range(len(PROMPTS))
    ]


def test_tokens_match_one_step_at_a_time(demo_dir: Path, make_engine: EngineFactory) -> None:
    reference = _run(make_engine(demo_dir), _params())
    for width in (2, 4):
        engine = make_engine(demo_dir, pipeline=PipelineConfig(max_concurrency=width))
        executor = engine.executor
        assert isinstance(executor, ThreadExecutor) and executor.uses_lanes
        assert len(executor.workers[0].lanes) == width
        assert _run(engine, _params()) == reference, f"max_concurrency={width}"


def test_tensor_parallel_lanes_match_tp1(demo_dir: Path, make_engine: EngineFactory) -> None:
    reference = _run(make_engine(demo_dir), _params())
    engine = make_engine(
        demo_dir,
        pipeline=PipelineConfig(max_concurrency=2),
        parallel=ParallelConfig(devices="cpu:0,cpu:1", single_process=True),
    )
    assert _run(engine, _params()) == reference


def test_serialize_switches_keep_results(demo_dir: Path, make_engine: EngineFactory) -> None:
    reference = _run(make_engine(demo_dir), _params())
    for pipeline in (
        PipelineConfig(max_concurrency=2, serialize_prepare=True),
        PipelineConfig(max_concurrency=2, serialize_forward=True),
    ):
        assert _run(make_engine(demo_dir, pipeline=pipeline), _params()) == reference


def test_abort_in_flight_frees_blocks_once_its_step_is_done(
    demo_dir: Path, make_engine: EngineFactory
) -> None:
    engine = make_engine(demo_dir, pipeline=PipelineConfig(max_concurrency=2))
    params = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0)
    ids = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(PROMPTS)]
    for _ in range(4):
        engine.step()
    aborted = engine.abort(ids[0])
    assert aborted is not None and aborted.finish_reason == "abort"
    while engine.has_unfinished():
        engine.step()
    # Drain what is still in flight, then every block is back.
    while engine.in_flight:
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_pipeline_lanes_refuse_one_process_per_device(demo_dir: Path) -> None:
    from ..conftest import engine_config

    config = engine_config(
        demo_dir,
        pipeline=PipelineConfig(max_concurrency=2),
        parallel=ParallelConfig(devices="cpu:0,cpu:1", master_node_addr="127.0.0.1:1"),
    )
    with pytest.raises(ConfigError, match="single-process mode"):
        LLMEngine(config)
    with pytest.raises(ConfigError, match="--max-concurrency must be >= 1"):
        PipelineConfig(max_concurrency=0)


def test_serialized_forwards_are_refused_with_tensor_parallelism(demo_dir: Path) -> None:
    """Each rank's forward lock would be taken in its own lane order: a deadlock."""
    from ..conftest import engine_config

    config = engine_config(
        demo_dir,
        pipeline=PipelineConfig(max_concurrency=2, serialize_forward=True),
        parallel=ParallelConfig(devices="cpu:0,cpu:1", single_process=True),
    )
    with pytest.raises(ConfigError, match=r"--serialize-forward .* tensor parallelism"):
        LLMEngine(config)
