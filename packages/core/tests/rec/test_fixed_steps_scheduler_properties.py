"""Property tests of the recommender's fixed-steps scheduler: random sequences of arrivals,
admissions and finished (or failed) batches keep every in-flight request's blocks reserved
and disjoint, the waiting ones without blocks, the lanes each either free or running one
batch, admission in arrival order, and every block free once everything is done."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tandem.core.errors import InvalidRequestError
from tandem.core.kv.block_manager import BlockManager
from tandem.core.models.rec_config import RecModelConfig
from tandem.core.rec.fixed_steps_scheduler import FixedStepsScheduler, RecBatch
from tandem.core.rec.request import RecRequest, make_rec_request

from ..kv.pool_invariants import check_pool

MODEL = RecModelConfig(
    num_codebooks=3, codebook_size=16, hidden_size=32, num_heads=4, head_dim=8,
    intermediate_size=64, num_encoder_layers=1, num_decoder_layers=1, max_history=40,
)  # fmt: skip
NUM_BLOCKS = 8
BLOCK_SIZE = 4
LANES = 3


class FixedStepsMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_cache=False)
        self.scheduler = FixedStepsScheduler(
            self.blocks, max_batch_size=2, max_concurrency=LANES, max_decode_rounds=2
        )
        self.arrived: list[RecRequest] = []
        self.admitted: list[RecRequest] = []
        self.in_flight: dict[int, RecBatch] = {}

    @rule(length=st.integers(1, 40))
    def arrive(self, length: int) -> None:
        request = make_rec_request([[1, 2, 3]] * length, 2, MODEL, beam_width=2)
        try:
            self.scheduler.add(request)
        except InvalidRequestError:
            assert self.scheduler.blocks_needed(request) > NUM_BLOCKS
            return
        self.arrived.append(request)

    @rule()
    def admit(self) -> None:
        batch = self.scheduler.next_batch()
        if batch is None:
            return
        assert batch.lane not in {b.lane for b in self.in_flight.values()}
        self.in_flight[batch.batch_id] = batch
        self.admitted += batch.requests
        for request in batch.requests:
            assert len(request.blocks) == self.scheduler.blocks_needed(request)

    @precondition(lambda self: bool(self.in_flight))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        batch_id = data.draw(st.sampled_from(sorted(self.in_flight)))
        self.scheduler.finish(self.in_flight.pop(batch_id))

    @invariant()
    def consistent(self) -> None:
        flying = [r for b in self.in_flight.values() for r in b.requests]
        check_pool(self.blocks, [r.blocks for r in flying])
        # First come, first served: admitted in arrival order.
        assert self.admitted == self.arrived[: len(self.admitted)]
        waiting = self.arrived[len(self.admitted) :]
        assert self.scheduler.num_waiting == len(waiting)
        assert all(not r.blocks for r in waiting), "a waiting request holds blocks"
        lanes = sorted(b.lane for b in self.in_flight.values())
        assert sorted(lanes + self.scheduler._free_lanes) == list(range(LANES))
        assert self.scheduler.num_in_flight == len(self.in_flight)
        assert not self.scheduler.stuck(), "a request that fits was left waiting for good"

    def teardown(self) -> None:
        for _ in range(200):
            for batch_id in sorted(self.in_flight):
                self.scheduler.finish(self.in_flight.pop(batch_id))
            self.admit()
            if not self.in_flight:
                break
        assert self.scheduler.num_waiting == 0 and not self.in_flight
        check_pool(self.blocks, [])


FixedStepsMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestFixedStepsScheduler = FixedStepsMachine.TestCase
