"""Steps launched ahead (one step at a time, ``PipelineConfig.overlap_steps``): the next
decode step starts before the outputs of the one that just completed are processed.

What must hold: the same tokens, text, finish reasons and logprobs as without it, on mixes of
greedy and seeded sampling, stop strings, stop tokens and lengths; a request ending on a
stop string while its next step runs, or aborted then, gives its blocks back once that step
completes; nothing is launched ahead while requests wait or when a request's next input
depends on the processing (grammars, penalties); the engine loop drains the last step."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

from tandem.core import EngineLoop, LLMEngine, SamplingParams
from tandem.core.config import PipelineConfig
from tandem.core.llm.outputs import RequestOutput

from ..conftest import EngineFactory


def _mix(seed: int, count: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(4, 40))] for _ in range(count)]
    params = []
    for i in range(count):
        kind = i % 4
        params.append(
            SamplingParams(
                max_tokens=rng.randrange(1, 30),
                temperature=0.0 if kind in (0, 1) else 0.8,
                seed=None if kind in (0, 1) else 1000 + i,
                stop=["e", "th"] if kind == 1 else [],
                stop_token_ids=[rng.randrange(3, 500) for _ in range(20)] if kind == 2 else [],
                logprobs=2 if kind == 3 else None,
            )
        )
    return prompts, params


def _summary(outs: list[RequestOutput]) -> list[tuple[object, ...]]:
    return [
        (
            o.token_ids,
            o.text,
            o.finish_reason,
            o.stop_reason,
            [(lp.token_id, round(lp.logprob, 4)) for lp in o.logprobs or []],
        )
        for o in outs
    ]


def _engine(make_engine: EngineFactory, model: Path, overlap: bool, **kwargs: object) -> LLMEngine:
    return make_engine(model, pipeline=PipelineConfig(overlap_steps=overlap), **kwargs)


def test_outputs_equal_one_step_at_a_time_without_it(
    demo_dir: Path, make_engine: EngineFactory
) -> None:
    prompts, params = _mix(seed=0, count=24)
    plain = _engine(make_engine, demo_dir, overlap=False)
    ahead = _engine(make_engine, demo_dir, overlap=True)
    expected = _summary(plain.generate(prompts, params))
    assert _summary(ahead.generate(prompts, params)) == expected
    assert plain.stats.num_steps_launched_ahead == 0
    assert ahead.stats.num_steps_launched_ahead > 10
    for engine in (plain, ahead):
        assert engine.stats.num_free_blocks == engine.stats.num_blocks
        assert engine.stats.num_steps_in_flight == 0


def test_a_stop_string_met_during_the_next_step_frees_its_blocks_after_it(
    demo_dir: Path, make_engine: EngineFactory
) -> None:
    """Every request decodes together; stop strings end them while their next step runs
    (that step's rows are dropped): the outputs stop at the strings and every block comes
    back."""
    engine = _engine(make_engine, demo_dir, overlap=True)
    reference = _engine(make_engine, demo_dir, overlap=False)
    prompts = [[5 + i, 17, 200, 42, 9] for i in range(8)]
    free_run = reference.generate(prompts, SamplingParams.greedy(max_tokens=40, ignore_eos=True))
    # Stop at the second character each request printed: mid-generation, after steps ran
    # ahead.
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[o.text[5:7]])
        for o in free_run
    ]
    outs = engine.generate(prompts, params)
    assert _summary(outs) == _summary(reference.generate(prompts, params))
    assert any(o.finish_reason == "stop" for o in outs)
    assert engine.stats.num_steps_launched_ahead > 0
    assert engine.stats.num_free_blocks == engine.stats.num_blocks
    assert engine.stats.num_steps_in_flight == 0


def test_an_abort_while_the_next_step_runs_frees_its_blocks_when_it_completes(
    demo_dir: Path, make_engine: EngineFactory
) -> None:
    engine = _engine(make_engine, demo_dir, overlap=True)
    ids = [
        engine.add_request(
            None, [9, 8, 7 + i], SamplingParams.greedy(max_tokens=50, ignore_eos=True)
        )
        for i in range(4)
    ]
    while engine.stats.num_steps_in_flight == 0:
        engine.step()
    held = engine.stats.num_blocks - engine.stats.num_free_blocks
    aborted = engine.abort(ids[0])
    assert aborted is not None and aborted.finish_reason == "abort"
    # Its step still writes its blocks: none come back yet.
    assert engine.stats.num_blocks - engine.block_manager.num_free_blocks == held
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert sorted(finished) == sorted(ids[1:])
    assert all(len(finished[i].token_ids) == 50 for i in ids[1:])
    assert engine.stats.num_free_blocks == engine.stats.num_blocks


def test_nothing_runs_ahead_while_requests_wait_or_need_the_processing(
    demo_dir: Path, make_engine: EngineFactory
) -> None:
    engine = _engine(make_engine, demo_dir, overlap=True)
    # Logits processors (repetition penalties here) keep their state from the tokens the
    # sampler draws, not from the processing: their requests run ahead, with the tokens of
    # one step at a time.
    penalized = SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.3)
    ahead = engine.generate([[5, 6, 7], [8, 9]], penalized)
    assert engine.stats.num_steps_launched_ahead > 0
    plain = _engine(make_engine, demo_dir, overlap=False).generate([[5, 6, 7], [8, 9]], penalized)
    assert [o.token_ids for o in ahead] == [o.token_ids for o in plain]
    # A request that arrives while others decode waits for the full path (admission).
    engine.add_request("first", [5, 6, 7], SamplingParams.greedy(max_tokens=30, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.add_request("late", [9, 9, 9], SamplingParams.greedy(max_tokens=5, ignore_eos=True))
    before = engine.stats.num_steps_launched_ahead
    engine.step()  # completes the step in flight: "late" waits, so nothing launches ahead
    assert engine.stats.num_steps_launched_ahead == before
    assert engine.stats.num_steps_in_flight == 0
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.num_free_blocks == engine.stats.num_blocks


def test_the_engine_loop_drains_the_step_left_running(
    demo_dir: Path, make_engine: EngineFactory
) -> None:
    """The last requests end on stop strings with their next step still running: the loop
    completes that step by itself, and their blocks come back without another request."""
    engine = _engine(make_engine, demo_dir, overlap=True)
    reference = _engine(make_engine, demo_dir, overlap=False)
    prompts = [[11 + i, 3, 99] for i in range(4)]
    free_run = reference.generate(prompts, SamplingParams.greedy(max_tokens=30, ignore_eos=True))
    params = [
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[o.text[4:6]])
        for o in free_run
    ]
    loop = EngineLoop(engine)
    done: dict[str, RequestOutput] = {}
    all_done = threading.Event()

    def on_output(out: RequestOutput) -> None:
        if out.finished:
            done[out.request_id] = out
            if len(done) == len(prompts):
                all_done.set()

    try:
        ids = [loop.submit(p, sp, on_output) for p, sp in zip(prompts, params, strict=True)]
        assert all_done.wait(60)
        expected = [o.text for o in reference.generate(prompts, params)]
        assert [done[i].text for i in ids] == expected
        deadline = time.monotonic() + 10
        while engine.stats.num_free_blocks != engine.stats.num_blocks:
            assert time.monotonic() < deadline, "the last step's blocks never came back"
            time.sleep(0.01)
        assert engine.stats.num_steps_in_flight == 0
    finally:
        loop.stop()


def test_steps_run_ahead_by_default_on_accelerators_only() -> None:
    auto = PipelineConfig()
    assert not auto.launches_ahead("cpu:0")
    assert not auto.launches_ahead("cpu:0,cpu:1")
    assert auto.launches_ahead("npu:0,npu:1")
    assert auto.launches_ahead("cuda:0")
    assert PipelineConfig(overlap_steps=True).launches_ahead("cpu:0")
    assert not PipelineConfig(overlap_steps=False).launches_ahead("npu:0")
    # Lanes have their own way of keeping steps in flight.
    assert not PipelineConfig(max_concurrency=2, overlap_steps=True).launches_ahead("npu:0")
