"""A hybrid model's state slots through the engine: taken at admission, carried across chunks
and decode steps, given back on finish, abort (also of a step in flight) and preemption; a
request waits for a slot rather than failing, a budget without one fails at start-up; a
prompt seen before starts from its state snapshot, and without room for snapshots prefix
caching is off with one log line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.core import ConfigError, InvalidRequestError, LLMEngine, SamplingParams
from tandem.core.config import PipelineConfig
from tandem.core.kv.kv_cache import GIB

from ..conftest import EngineFactory, assert_all_returned, engine_config

PROMPTS = [[7 + (i * 11 + j) % 480 for j in range(9 + 7 * i)] for i in range(6)]
PARAMS = SamplingParams.greedy(max_tokens=20, ignore_eos=True)


def _tokens(engine: LLMEngine) -> list[list[int]]:
    outs = engine.generate(PROMPTS, PARAMS)
    assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs]


def _assert_all_returned(engine: LLMEngine) -> None:
    assert engine.stats.num_state_slots > 0
    assert_all_returned(engine)


@pytest.fixture(scope="module")
def reference(hybrid_dir: Path) -> list[list[int]]:
    """Every prompt alone, with room for everything."""
    engine = LLMEngine(engine_config(hybrid_dir))
    try:
        return [engine.generate([p], PARAMS)[0].token_ids for p in PROMPTS]
    finally:
        engine.shutdown()


def test_requests_wait_for_a_free_slot_and_get_the_same_tokens(
    hybrid_dir: Path, make_engine: EngineFactory, reference: list[list[int]]
) -> None:
    engine = make_engine(hybrid_dir, num_state_slots=2, max_tokens_per_batch=16)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, PARAMS)
    tokens: dict[str, list[int]] = {}
    waited_with_free_blocks = False
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
        stats = engine.stats
        # Slots, not blocks, are what holds the others back.
        assert stats.num_running <= 2
        waited_with_free_blocks |= stats.num_waiting > 0 and stats.num_free_blocks > 100
    assert waited_with_free_blocks
    assert engine.scheduler.num_preemptions == 0
    assert [tokens[f"r{i}"] for i in range(len(PROMPTS))] == reference
    _assert_all_returned(engine)


def test_preempted_sequences_restart_from_a_zero_state(
    hybrid_dir: Path, make_engine: EngineFactory, reference: list[list[int]]
) -> None:
    # 12 blocks of 8 tokens: the six requests (up to 64 tokens each) cannot all run at once.
    engine = make_engine(hybrid_dir, num_blocks=12, block_size=8, max_tokens_per_batch=24)
    assert _tokens(engine) == reference
    assert engine.scheduler.num_preemptions > 0
    _assert_all_returned(engine)


@pytest.mark.parametrize("width", [1, 3])
def test_aborts_return_every_slot_also_with_their_step_in_flight(
    width: int, hybrid_dir: Path, make_engine: EngineFactory, reference: list[list[int]]
) -> None:
    engine = make_engine(
        hybrid_dir, num_state_slots=3, pipeline=PipelineConfig(max_concurrency=width)
    )
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, PARAMS)
    finished: dict[str, list[int]] = {}
    aborted_in_flight = 0
    steps = 0
    while engine.has_unfinished():
        steps += 1
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.token_ids
        if steps % 4 == 0:
            # Abort the oldest running request that is not done, in flight or not.
            running = [s for s in engine.scheduler.running if s.request_id not in ("r0", "r5")]
            if running:
                victim = running[0].request_id
                aborted_in_flight += victim in engine.in_flight.busy_ids()
                ended = engine.abort(victim)
                assert ended is not None and ended.finish_reason == "abort"
    while engine.step() or engine.in_flight:
        pass
    if width > 1:
        assert aborted_in_flight > 0, "no abort hit a step in flight"
    # The requests never aborted are untouched by the others' aborts.
    assert finished["r0"] == reference[0] and finished["r5"] == reference[5]
    _assert_all_returned(engine)


def test_a_budget_without_room_for_one_slot_fails_at_start_up(
    hybrid_dir: Path, make_engine: EngineFactory
) -> None:
    weights = make_engine(hybrid_dir).executor.memory.weight_bytes
    # Room for the weights and a few KB: less than two slots, so half of it holds none.
    budget = (weights + 4096) / 0.9 / GIB
    with pytest.raises(ConfigError, match="linear-attention state slot") as failure:
        make_engine(hybrid_dir, num_blocks=None, cpu_memory_gb=budget)
    assert "--cpu-memory-gb" in str(failure.value)


def test_a_request_that_can_never_fit_fails_at_once_while_others_run(
    hybrid_dir: Path, make_engine: EngineFactory, reference: list[list[int]]
) -> None:
    engine = make_engine(hybrid_dir, num_blocks=8, num_state_slots=1)
    first = engine.add_request("first", PROMPTS[0], PARAMS)
    waiting = engine.add_request("waiting", PROMPTS[1], PARAMS)
    with pytest.raises(InvalidRequestError, match="more than the whole cache holds"):
        engine.add_request("huge", PROMPTS[2], SamplingParams.greedy(max_tokens=200))
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    assert done == {first: reference[0], waiting: reference[1]}
    _assert_all_returned(engine)


def test_a_prompt_that_continues_another_starts_from_its_snapshot(
    hybrid_dir: Path, make_engine: EngineFactory, reference: list[list[int]]
) -> None:
    engine = make_engine(hybrid_dir)
    assert engine.block_manager.enable_prefix_cache and engine.scheduler.snapshots is not None
    assert engine.generate([PROMPTS[3]], PARAMS)[0].token_ids == reference[3]
    follow_up = PROMPTS[3] + [5, 6, 7]
    again = engine.generate([follow_up], PARAMS)[0]
    # The first prompt came from the cache, KV and state, as it ended.
    assert again.num_cached_tokens == len(PROMPTS[3])
    assert engine.stats.state_snapshot_hits == 1
    alone = make_engine(hybrid_dir, enable_prefix_cache=False)
    assert again.token_ids == alone.generate([follow_up], PARAMS)[0].token_ids
    _assert_all_returned(engine)


def test_no_room_for_snapshots_turns_prefix_caching_off_with_one_log_line(
    hybrid_dir: Path,
    make_engine: EngineFactory,
    reference: list[list[int]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="tandem.core.llm.engine")
    engine = make_engine(hybrid_dir, enable_prefix_cache=True, state_cache_mb=0)
    lines = [r.getMessage() for r in caplog.records if "prefix caching is off" in r.getMessage()]
    assert len(lines) == 1 and "--state-cache-mb" in lines[0]
    assert not engine.block_manager.enable_prefix_cache
    twice = engine.generate([PROMPTS[3], PROMPTS[3]], PARAMS)
    assert [o.token_ids for o in twice] == [reference[3], reference[3]]
    assert all(o.num_cached_tokens == 0 for o in twice)


def test_state_slots_for_a_config_without_linear_attention_are_refused(
    demo_dir: Path, make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model whose layers keep state (the workers made slots for them) but whose config
    says it has none: one slot shared by every sequence must never be served."""
    from tandem.core.executor.thread_executor import ThreadExecutor

    monkeypatch.setattr(ThreadExecutor, "num_state_slots", property(lambda self: 4))
    with pytest.raises(ConfigError, match="has_linear_attention"):
        make_engine(demo_dir)
