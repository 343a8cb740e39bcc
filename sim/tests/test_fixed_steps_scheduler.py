"""The fixed-steps scheduler and the recommendation engine loop, on a fake engine that fakes
only the block pool and holds steps open on demand (``tandem_sim.fake_engine``)."""

from __future__ import annotations

import time

import pytest
from tandem_sim.fake_engine import FakeEngine

from tandem.core.errors import EngineDeadError, EngineUnhealthyError, InvalidRequestError
from tandem.core.models.rec_config import RecModelConfig
from tandem.core.rec.engine import RecEngine
from tandem.core.rec.fixed_steps_scheduler import FixedStepsScheduler
from tandem.core.rec.request import RecRequest, RecResult, make_rec_request

MODEL = RecModelConfig(
    num_codebooks=3, codebook_size=16, hidden_size=32, num_heads=4, head_dim=8,
    intermediate_size=64, num_encoder_layers=1, num_decoder_layers=1, max_history=200,
)  # fmt: skip
ROUNDS = MODEL.max_decode_rounds


def request(history_len: int, num_candidates: int = 2) -> RecRequest:
    return make_rec_request([[1, 2, 3]] * history_len, num_candidates, MODEL, beam_width=4)


def start(
    fake: FakeEngine, max_concurrency: int, max_batch_size: int = 1
) -> tuple[RecEngine, FixedStepsScheduler]:
    scheduler = FixedStepsScheduler(
        fake.blocks,
        max_batch_size=max_batch_size,
        max_concurrency=max_concurrency,
        max_decode_rounds=ROUNDS,
    )
    return RecEngine(fake, scheduler), scheduler


def results(requests: list[RecRequest]) -> list[RecResult]:
    return [r.result.result(timeout=10) for r in requests]


def test_in_flight_batches_are_capped_and_every_block_comes_back() -> None:
    fake = FakeEngine(num_blocks=64, block_size=16, max_decode_rounds=ROUNDS)
    engine, scheduler = start(fake, max_concurrency=2)
    fake.hold()
    requests = [request(history_len=10) for _ in range(5)]
    for r in requests:
        engine.submit(r)
    fake.wait_open(2)
    assert sorted(lane for lane, _, _ in fake.open_steps) == [0, 1]
    assert scheduler.num_in_flight == 2 and scheduler.num_waiting == 3
    # Two batches of one request each hold one block apiece.
    assert fake.blocks.num_free_blocks == 62
    fake.release()
    done = results(requests)
    assert [len(d.candidates) for d in done] == [2] * 5
    assert fake.max_open == 2
    # One prefill and ROUNDS decode rounds per batch, no more.
    assert fake.step_calls == 5 * (1 + ROUNDS)
    assert not fake.violations
    assert fake.blocks.num_free_blocks == 64 and scheduler.num_in_flight == 0
    engine.stop()


def test_out_of_blocks_waits_for_in_flight_steps_instead_of_failing() -> None:
    fake = FakeEngine(num_blocks=3, block_size=16, max_decode_rounds=ROUNDS)
    engine, scheduler = start(fake, max_concurrency=2)
    fake.hold()
    first, second = request(history_len=20), request(history_len=20)  # 2 blocks each
    engine.submit(first)
    engine.submit(second)
    fake.wait_open(1)
    # A lane is free but the blocks are not: the second request waits, it does not fail.
    assert scheduler.num_in_flight == 1 and scheduler.num_waiting == 1
    assert not second.result.done()
    while not first.result.done():
        fake.wait_open(1)
        fake.release(1)
    fake.release()
    assert len(results([first, second])) == 2
    assert fake.blocks.num_free_blocks == 3 and not fake.violations
    engine.stop()


def test_a_request_that_could_never_fit_fails_at_once() -> None:
    fake = FakeEngine(num_blocks=3, block_size=16, max_decode_rounds=ROUNDS)
    engine, scheduler = start(fake, max_concurrency=2)
    with pytest.raises(InvalidRequestError, match="needs 4 KV blocks and the cache has 3") as err:
        engine.submit(request(history_len=64))
    assert err.value.param == "history"
    assert scheduler.num_waiting == 0
    # The engine goes on serving requests that fit.
    ok = request(history_len=5)
    engine.submit(ok)
    # Several at once: one that can never fit refuses the lot.
    with pytest.raises(InvalidRequestError):
        engine.submit(request(history_len=3), request(history_len=64))
    assert scheduler.num_waiting <= 1  # `ok` may still wait; the refused pair did not queue
    assert results([ok])[0].candidates
    engine.stop()


def test_no_request_starves_behind_smaller_ones() -> None:
    """A big request at the head waits for blocks; smaller ones behind it do not overtake it
    (they would keep the pool busy and the big one would never run)."""
    fake = FakeEngine(num_blocks=3, block_size=16, max_decode_rounds=ROUNDS)
    engine, scheduler = start(fake, max_concurrency=3)
    fake.hold()
    small = request(history_len=10)
    engine.submit(small)
    fake.wait_open(1)
    big, later = request(history_len=40), request(history_len=10)  # 3 blocks, 1 block
    engine.submit(big)
    engine.submit(later)
    # 2 blocks free and a lane free: `later` would fit, but `big` is first in line.
    assert scheduler.num_waiting == 2 and [b for _, b, _ in fake.open_steps] == [0]
    order: list[int] = []
    while len(order) < 3:
        fake.wait_open(1)
        for _, batch, step_round in fake.open_steps:
            if step_round == 0 and batch not in order:
                order.append(batch)
        fake.release(1)
    fake.release()
    results([small, big, later])
    # Batches are numbered as admitted: small (0), then big (1), then later (2).
    assert order == [0, 1, 2]
    assert fake.blocks.num_free_blocks == 3 and not fake.violations
    engine.stop()


def test_batches_group_requests_and_keep_their_order() -> None:
    fake = FakeEngine(num_blocks=64, block_size=16, max_decode_rounds=ROUNDS)
    engine, _ = start(fake, max_concurrency=2, max_batch_size=3)
    fake.hold()
    requests = [request(history_len=4, num_candidates=1 + i % 3) for i in range(7)]
    for r in requests:
        engine.submit(r)
    fake.release()
    done = results(requests)
    assert [len(d.candidates) for d in done] == [1 + i % 3 for i in range(7)]
    assert [d.request_id for d in done] == [r.request_id for r in requests]
    assert not fake.violations
    engine.stop()


def test_stopping_fails_waiting_requests_instead_of_losing_them() -> None:
    fake = FakeEngine(num_blocks=64, block_size=16, max_decode_rounds=ROUNDS)
    engine, _ = start(fake, max_concurrency=1)
    fake.hold()
    running, waiting = request(history_len=3), request(history_len=3)
    engine.submit(running)
    engine.submit(waiting)
    fake.wait_open(1)
    engine.stop()
    with pytest.raises(EngineDeadError):
        waiting.result.result(timeout=5)
    with pytest.raises(EngineDeadError):
        running.result.result(timeout=5)
    with pytest.raises(EngineDeadError):
        engine.submit(request(history_len=3))
    assert fake.blocks.num_free_blocks == 64


def test_requests_queued_together_batch_the_same_at_every_width() -> None:
    batches: dict[int, list[list[int]]] = {}
    for width in (1, 2, 4):
        fake = FakeEngine(num_blocks=64, block_size=16, max_decode_rounds=ROUNDS)
        engine, _ = start(fake, max_concurrency=width, max_batch_size=3)
        fake.hold()
        requests = [request(history_len=2) for _ in range(8)]
        engine.submit(*requests)
        fake.release()
        done = results(requests)
        # The fake names candidates (batch id, i): which requests shared a batch.
        batches[width] = [[d.candidates[0][0]] for d in done]
        engine.stop()
    assert batches[1] == batches[2] == batches[4] == [[0]] * 3 + [[1]] * 3 + [[2]] * 2


def test_a_step_past_the_health_deadline_is_unhealthy_and_one_past_the_timeout_fails() -> None:
    fake = FakeEngine(num_blocks=64, block_size=16, max_decode_rounds=ROUNDS)
    scheduler = FixedStepsScheduler(
        fake.blocks, max_batch_size=1, max_concurrency=1, max_decode_rounds=ROUNDS
    )
    engine = RecEngine(fake, scheduler, step_timeout_s=1.0, health_timeout_s=0.2)
    fake.hold()
    held = request(history_len=3)
    engine.submit(held)
    fake.wait_open(1)
    time.sleep(0.4)
    with pytest.raises(EngineUnhealthyError) as unhealthy:
        engine.check_health()
    assert not isinstance(unhealthy.value, EngineDeadError)
    # Past the step timeout (and its grace) the engine fails the request, saying so.
    with pytest.raises(EngineDeadError, match="held lane 0"):
        held.result.result(timeout=10)
    with pytest.raises(EngineDeadError, match="held lane 0"):
        engine.check_health()
    assert fake.blocks.num_free_blocks == 64
    fake.release()
    engine.stop()


def test_blocks_that_leaked_fail_the_waiting_requests_instead_of_holding_them() -> None:
    fake = FakeEngine(num_blocks=4, block_size=16, max_decode_rounds=ROUNDS)
    engine, _ = start(fake, max_concurrency=1)
    fake.blocks.reserve(3)  # a leak: only one block is left, and nothing will return any
    stuck = request(history_len=20)  # needs two
    engine.submit(stuck)
    with pytest.raises(EngineDeadError, match="could not admit 1 waiting"):
        stuck.result.result(timeout=10)
    assert not engine.is_running
