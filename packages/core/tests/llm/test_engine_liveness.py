"""The engine always makes progress: under KV pressure with several steps in flight, with
random mixes of pool sizes, lengths, widths and aborts, and never by spinning in place; for
hybrid models also when state slots, not blocks, are what runs out (requests wait for a slot
at admission, and running ones give theirs back as they end or are preempted).

The livelock these tests hold: with ``--max-concurrency`` above 1, once every running
sequence had exactly one token to compute and none had room for its next block, only the
decode-only path was asked, it skipped them all and never preempted, and the engine loop
spun forever with nothing in flight.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from tandem.core import EngineLoop, LLMEngine, RequestOutput, SamplingParams
from tandem.core.config import PipelineConfig
from tandem.core.llm.scheduler import SchedulerOutput

from ..conftest import EngineFactory, assert_all_returned

# The case, scaled to the test model: prompts of 60 + 3i tokens, 64 new tokens each,
# a pool of 64 blocks of 16 tokens that holds about four of them at once.
PROMPTS = [[3 + (i * 7 + j) % 500 for j in range(60 + 3 * i)] for i in range(12)]
PARAMS = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0)


def _serve(engine: LLMEngine, deadline_s: float) -> dict[str, RequestOutput]:
    """Submit every prompt through the engine loop at once (as a server does) and wait for
    each to finish; fails on the deadline instead of hanging."""
    finished: dict[str, RequestOutput] = {}
    done = threading.Event()
    lock = threading.Lock()

    def on_output(out: RequestOutput) -> None:
        if out.finished:
            with lock:
                finished[out.request_id] = out
                if len(finished) == len(PROMPTS):
                    done.set()

    loop = EngineLoop(engine)
    try:
        for i, prompt in enumerate(PROMPTS):
            loop.submit(prompt, PARAMS, on_output, request_id=f"r{i}")
        assert done.wait(deadline_s), (
            f"{len(PROMPTS) - len(finished)} of {len(PROMPTS)} requests never finished: "
            f"running {engine.scheduler.num_running}, waiting {engine.scheduler.num_waiting}, "
            f"free blocks {engine.block_manager.num_free_blocks}"
        )
    finally:
        loop.stop()
    return finished


@pytest.mark.parametrize("model", ["demo", "hybrid"])
def test_lanes_under_kv_pressure_finish_like_one_step_at_a_time(
    model: str, demo_dir: Path, hybrid_dir: Path, make_engine: EngineFactory
) -> None:
    folder = demo_dir if model == "demo" else hybrid_dir
    reference_engine = make_engine(folder, num_blocks=64)
    reference = _serve(reference_engine, deadline_s=120)
    assert reference_engine.scheduler.num_preemptions > 0, "the pool must be under pressure"
    for width in (2, 3):
        engine = make_engine(folder, num_blocks=64, pipeline=PipelineConfig(max_concurrency=width))
        outs = _serve(engine, deadline_s=120)
        assert engine.scheduler.num_preemptions > 0, f"width {width}: nothing was preempted"
        for rid, out in outs.items():
            assert out.finish_reason == "length", f"width {width}, {rid}: {out.error}"
            assert out.token_ids == reference[rid].token_ids, f"width {width}, {rid}"
        _assert_all_returned(engine)


def _assert_all_returned(engine: LLMEngine) -> None:
    assert_all_returned(engine)


def _run_bounded(engine: LLMEngine, rng: random.Random, params: list[SamplingParams]) -> int:
    """Step until every request ended, aborting some at random points; returns the steps
    taken. Fails once the steps exceed a bound that any progressing engine stays under."""
    ids = [
        engine.add_request(f"q{i}", [5 + (i * 13 + j) % 400 for j in range(rng.randint(1, 90))], p)
        for i, p in enumerate(params)
    ]
    to_abort = set(rng.sample(ids, k=len(ids) // 4))
    # Each step computes at least one token of some request (or preempts one, which must be
    # redone): a generous multiple of all the tokens there are bounds a live engine.
    bound = 20 * sum(90 + p.max_tokens for p in params)
    steps = 0
    while engine.has_unfinished():
        steps += 1
        assert steps <= bound, (
            f"no end after {steps} steps: running {engine.scheduler.num_running}, "
            f"waiting {engine.scheduler.num_waiting}"
        )
        engine.step()
        if to_abort and rng.random() < 0.1:
            engine.abort(to_abort.pop())
    while engine.step() or engine.in_flight:
        pass
    return steps


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("model", ["demo", "hybrid"])
def test_random_mixes_always_finish(
    model: str, seed: int, demo_dir: Path, hybrid_dir: Path, make_engine: EngineFactory
) -> None:
    rng = random.Random(seed)
    width = rng.randint(1, 4)
    block_size = rng.choice([4, 8, 16])
    num_params = rng.randint(4, 10)
    params = [
        SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True, temperature=0.0)
        for _ in range(num_params)
    ]
    # Small enough to force preemption, large enough for the longest request alone.
    longest = 90 + max(p.max_tokens for p in params)
    num_blocks = -(-longest // block_size) + rng.randint(0, 6)
    # Hybrid: as few as one state slot, so that admissions wait for slots, not blocks.
    slots = rng.choice([1, 2, 3, None]) if model == "hybrid" else None
    engine = make_engine(
        demo_dir if model == "demo" else hybrid_dir,
        num_blocks=num_blocks,
        num_state_slots=slots,
        block_size=block_size,
        enable_prefix_cache=rng.random() < 0.5,
        max_tokens_per_batch=rng.choice([32, 64, 2048]),
        pipeline=PipelineConfig(max_concurrency=width),
    )
    _run_bounded(engine, rng, params)
    _assert_all_returned(engine)


class _StuckScheduler:
    """Stands in for a scheduler bug: it holds requests but never schedules them."""

    @staticmethod
    def install(engine: LLMEngine) -> list[int]:
        calls = [0]

        def nothing(*_: object, **__: object) -> SchedulerOutput:
            calls[0] += 1
            return SchedulerOutput()

        engine.scheduler.schedule = nothing  # type: ignore[method-assign]
        engine.scheduler.schedule_decodes = nothing  # type: ignore[method-assign]
        return calls


@pytest.mark.parametrize("width", [1, 2])
def test_watchdog_fails_stuck_requests_without_spinning(
    width: int, demo_dir: Path, make_engine: EngineFactory
) -> None:
    engine = make_engine(
        demo_dir,
        stall_timeout_s=0.5,
        pipeline=PipelineConfig(max_concurrency=width),
    )
    calls = _StuckScheduler.install(engine)
    finished: list[RequestOutput] = []
    done = threading.Event()

    def on_output(out: RequestOutput) -> None:
        if out.finished:
            finished.append(out)
            done.set()

    loop = EngineLoop(engine)
    try:
        loop.submit([5, 6, 7], PARAMS, on_output, request_id="stuck")
        assert done.wait(30), "the watchdog never failed the stuck request"
        # The loop blocked between the idle steps: a spinning loop calls the scheduler
        # hundreds of thousands of times in half a second.
        assert calls[0] < 50, f"the engine loop spun: {calls[0]} scheduling passes"
    finally:
        loop.stop()
    (out,) = finished
    assert out.finish_reason == "error"
    assert out.error is not None and "could not schedule" in out.error
    assert "running 0" in out.error and "waiting 1" in out.error
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_offline_generation_fails_a_stall_at_once(
    demo_dir: Path, make_engine: EngineFactory
) -> None:
    engine = make_engine(demo_dir)
    _StuckScheduler.install(engine)
    (out,) = engine.generate([[5, 6, 7]], PARAMS)
    assert out.finish_reason == "error" and out.error is not None
    assert "could not schedule" in out.error


def test_a_preempted_sequence_past_the_budget_runs_alone_without_chunking(
    demo_dir: Path, make_engine: EngineFactory
) -> None:
    """Without chunked prefill, a preempted sequence grown past the token budget by its own
    output must still be recomputed (alone) instead of waiting for ever."""
    engine = make_engine(
        demo_dir,
        # Both prompts run side by side until the pool is full; the newer one is preempted
        # with 55 tokens, more than the 48-token budget.
        num_blocks=14,
        block_size=8,
        enable_chunked_prefill=False,
        max_tokens_per_batch=48,
        enable_prefix_cache=False,
    )
    params = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0)
    prompts = [[7 + i + j for j in range(45)] for i in range(2)]
    solo = [make_engine(demo_dir).generate([p], params)[0].token_ids for p in prompts]
    outs = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == solo
