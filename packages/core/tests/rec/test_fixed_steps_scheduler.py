"""The fixed-steps scheduler's capacity: no more than --max-num-seqs requests in flight
whatever the lanes and batches allow, and past those plus --max-waiting-requests, new ones
refused at once with nothing queued."""

from __future__ import annotations

import pytest

from tandem.core import EngineConfig, ModelLoadConfig
from tandem.core.admission import EngineCapacity
from tandem.core.config import PipelineConfig, RecConfig, SchedulerConfig
from tandem.core.errors import EngineOverloadedError
from tandem.core.kv.block_manager import BlockManager
from tandem.core.models.rec_config import RecModelConfig
from tandem.core.rec.fixed_steps_scheduler import FixedStepsScheduler, rec_capacity
from tandem.core.rec.request import RecRequest, make_rec_request

MODEL = RecModelConfig(
    num_codebooks=3, codebook_size=16, hidden_size=32, num_heads=4, head_dim=8,
    intermediate_size=64, num_encoder_layers=1, num_decoder_layers=1, max_history=40,
)  # fmt: skip


def _request() -> RecRequest:
    return make_rec_request([[1, 2, 3]] * 5, 2, MODEL, beam_width=4)


def _scheduler(capacity: EngineCapacity) -> FixedStepsScheduler:
    blocks = BlockManager(64, 4, enable_prefix_cache=False)
    return FixedStepsScheduler(
        blocks, max_batch_size=3, max_concurrency=2, max_decode_rounds=2, capacity=capacity
    )


def test_requests_in_flight_stop_at_the_running_places() -> None:
    scheduler = _scheduler(EngineCapacity(running=4, running_why="--max-num-seqs 4"))
    scheduler.add(*(_request() for _ in range(8)))
    first = scheduler.next_batch()
    second = scheduler.next_batch()
    assert first is not None and second is not None
    # Two lanes of 3 would run 6; the second batch takes only what is left of 4.
    assert [len(first.requests), len(second.requests)] == [3, 1]
    assert scheduler.num_running == 4 and scheduler.num_waiting == 4
    scheduler.finish(second)
    again = scheduler.next_batch()
    assert again is not None and len(again.requests) == 1
    scheduler.finish(first)
    last = scheduler.next_batch()
    assert last is not None and len(last.requests) == 3


def test_past_the_running_and_waiting_places_new_requests_are_refused() -> None:
    scheduler = _scheduler(EngineCapacity(2, "--max-num-seqs 2", waiting=3))
    for _ in range(5):
        scheduler.add(_request())
    batch = scheduler.next_batch()
    assert batch is not None and len(batch.requests) == 2
    # Running ones count as well as waiting ones: 2 + 3 are in, the sixth is refused.
    with pytest.raises(EngineOverloadedError, match="--max-num-seqs 2 can run") as refused:
        scheduler.add(_request())
    assert refused.value.retry_after_s == 1
    assert scheduler.num_waiting == 3
    # A finished batch frees its places.
    scheduler.finish(batch)
    scheduler.add(_request(), _request())
    assert scheduler.num_waiting == 5


def test_the_running_places_are_the_lanes_batches_within_max_num_seqs() -> None:
    def config(max_num_seqs: int) -> EngineConfig:
        return EngineConfig(
            model=ModelLoadConfig(model="unused"),
            scheduler=SchedulerConfig(max_seqs_per_batch=max_num_seqs, max_waiting_requests=7),
            pipeline=PipelineConfig(max_concurrency=2),
            rec=RecConfig(max_batch_size=3),
        )

    assert rec_capacity(config(4)) == EngineCapacity(4, "--max-num-seqs 4", 7)
    lanes = rec_capacity(config(64))
    assert (lanes.running, lanes.waiting) == (6, 7)
    assert "--max-concurrency 2 batches of --rec-max-batch-size 3" in lanes.running_why
