"""Scheduling: budgets, chunked prefill, preemption of the newest, waiting for room."""

from __future__ import annotations

from tandem.core.config import SchedulerConfig, SpeculativeConfig
from tandem.core.kv.block_manager import BlockManager
from tandem.core.llm.drafting import Drafter
from tandem.core.llm.sampling_params import SamplingParams
from tandem.core.llm.scheduler import Scheduler, SchedulerOutput
from tandem.core.llm.sequence import SequenceStatus, TokenSequence


def _seq(rid: str, n: int, arrival: float) -> TokenSequence:
    seq = TokenSequence(
        request_id=rid,
        prompt_token_ids=list(range(1, n + 1)),
        params=SamplingParams(max_tokens=100),
        eos_token_ids=frozenset(),
        max_total_tokens=10_000,
    )
    seq.metrics.arrival_time = arrival
    return seq


def _complete(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """Pretend the step ran: advance and append a token to every sampling sequence."""
    scheduler.on_step_done(out)
    for entry in out.scheduled:
        if entry.samples:
            entry.seq.token_ids.append(7)


def _scheduler(
    num_blocks: int = 64, tokens: int = 64, seqs: int = 8, chunked: bool = True
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_tokens_per_batch=tokens, max_seqs_per_batch=seqs, enable_chunked_prefill=chunked
        ),
        BlockManager(num_blocks=num_blocks, block_size=4, enable_prefix_cache=False),
    )


def test_chunked_prefill_splits_by_token_budget_and_decodes_come_first() -> None:
    s = _scheduler(tokens=10)
    s.add(_seq("long", 25, arrival=0))
    steps = []
    while s.running == [] or s.running[0].num_computed_tokens < 25:
        out = s.schedule()
        steps.append([(e.seq.request_id, e.num_new_tokens, e.samples) for e in out.scheduled])
        _complete(s, out)
    assert steps == [[("long", 10, False)], [("long", 10, False)], [("long", 5, True)]]
    s.add(_seq("short", 3, arrival=1))
    out = s.schedule()
    assert [(e.seq.request_id, e.num_new_tokens) for e in out.scheduled] == [
        ("long", 1),
        ("short", 3),
    ]


def test_without_chunking_a_prompt_waits_for_a_step_with_room() -> None:
    s = _scheduler(tokens=10, chunked=False)
    s.add(_seq("a", 6, arrival=0))
    s.add(_seq("b", 6, arrival=1))
    out = s.schedule()
    assert [e.seq.request_id for e in out.scheduled] == ["a"]
    _complete(s, out)
    out = s.schedule()
    assert [(e.seq.request_id, e.num_new_tokens) for e in out.scheduled] == [("a", 1), ("b", 6)]


def test_sequence_budget() -> None:
    s = _scheduler(seqs=2)
    for i in range(3):
        s.add(_seq(f"r{i}", 2, arrival=i))
    out = s.schedule()
    assert len(out.scheduled) == 2 and s.num_waiting == 1


def test_decode_out_of_blocks_preempts_the_newest() -> None:
    s = _scheduler(num_blocks=2)
    s.add(_seq("old", 4, arrival=0))
    s.add(_seq("new", 4, arrival=1))
    out = s.schedule()
    assert len(out.scheduled) == 2
    _complete(s, out)
    # Each now needs a second block; only one sequence can have it.
    out = s.schedule()
    assert [e.seq.request_id for e in out.scheduled] == ["old"]
    assert [p.request_id for p in out.preempted] == ["new"]
    new = out.preempted[0]
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0
    assert new.block_table == [] and s.waiting[0] is new


def test_waiting_request_waits_for_blocks_instead_of_failing() -> None:
    s = _scheduler(num_blocks=2)
    s.add(_seq("a", 8, arrival=0))
    s.add(_seq("b", 4, arrival=1))
    out = s.schedule()
    assert [e.seq.request_id for e in out.scheduled] == ["a"]
    assert s.num_waiting == 1
    s.finish(s.running[0], "stop")
    out = s.schedule()
    assert [e.seq.request_id for e in out.scheduled] == ["b"]


def _drafting_scheduler(num_blocks: int, tokens: int) -> Scheduler:
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=2, prompt_lookup_min=1)
    return Scheduler(
        SchedulerConfig(max_tokens_per_batch=tokens, max_seqs_per_batch=8),
        BlockManager(num_blocks=num_blocks, block_size=4, enable_prefix_cache=False),
        drafter=Drafter(spec, uses_processor=lambda seq: False),
    )


def _decoding(scheduler: Scheduler, prompt: list[int]) -> TokenSequence:
    seq = TokenSequence("r", prompt, SamplingParams(max_tokens=100), frozenset(), 10_000)
    scheduler.add(seq)
    _complete(scheduler, scheduler.schedule())
    return seq


def test_a_decode_with_drafts_schedules_them_within_the_token_budget() -> None:
    s = _drafting_scheduler(num_blocks=64, tokens=64)
    seq = _decoding(s, [1, 2, 3, 7, 1, 2, 3])  # + 7: the suffix 3, 7 occurred before
    out = s.schedule()
    assert [(e.num_new_tokens, e.draft_token_ids, e.samples) for e in out.scheduled] == [
        (5, (1, 2, 3, 7), True)
    ]
    assert len(seq.block_table) == 3  # positions 0..11
    # A budget of 3 tokens: the prompt goes in chunks, and a step with drafts has two.
    s = _drafting_scheduler(num_blocks=64, tokens=3)
    s.add(
        TokenSequence("r", [1, 2, 3, 7, 1, 2, 3], SamplingParams(max_tokens=100), frozenset(), 99)
    )
    steps = []
    for _ in range(4):
        out = s.schedule()
        steps.append([(e.num_new_tokens, e.draft_token_ids) for e in out.scheduled])
        _complete(s, out)
    # The last prompt token samples, so it verifies drafts too: 2, 3 occurred before.
    assert steps == [[(3, ())], [(3, ())], [(3, (7, 1))], [(3, (1, 2))]]


def test_a_one_token_chunk_inside_a_prompt_gets_no_drafts() -> None:
    """A prefill cut one token short of a planned snapshot (hybrid prefix caching) has budget
    left, but its step samples nothing: drafts (here found in the prompt's own repeats) would
    have nothing to be checked against, and would take the place of prompt tokens."""
    s = _drafting_scheduler(num_blocks=64, tokens=3)
    seq = TokenSequence("q", [1, 2, 1, 2, 1, 2], SamplingParams(max_tokens=9), frozenset(), 99)
    s.add(seq)
    _complete(s, s.schedule())  # the first 3 prompt tokens
    seq.snapshot_cut = 4  # the scheduler plans one here when a cached prefix ends there
    out = s.schedule()
    assert [(e.num_new_tokens, e.draft_token_ids, e.samples) for e in out.scheduled] == [
        (1, (), False)
    ]


def test_drafts_are_dropped_rather_than_preempt_anyone() -> None:
    # Two blocks hold the 8 tokens: drafts would need a third, and none is free.
    s = _drafting_scheduler(num_blocks=2, tokens=64)
    _decoding(s, [1, 2, 3, 7, 1, 2, 3])
    out = s.schedule()
    assert [(e.num_new_tokens, e.draft_token_ids) for e in out.scheduled] == [(1, ())]
    assert not out.preempted
