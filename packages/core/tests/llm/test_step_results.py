"""A verify step's results written into its sequences: accepted drafts appended, a stop
token or a stop string inside an accepted run ends the output there, and the scheduler
counts only verified tokens as computed and gives back the blocks of rejected ones."""

from __future__ import annotations

from pathlib import Path

from tandem.core.config import SchedulerConfig
from tandem.core.kv.block_manager import BlockManager
from tandem.core.llm.forward_input import SamplerOutput
from tandem.core.llm.output_processor import OutputProcessor
from tandem.core.llm.sampling_params import SamplingParams
from tandem.core.llm.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from tandem.core.llm.sequence import SequenceStatus, TokenSequence
from tandem.core.llm.spec_decode_stats import SpecDecodeStats
from tandem.core.llm.step_results import accept_drafts, append_sampled
from tandem.core.llm.tokenizer import Tokenizer


def _running(params: SamplingParams, prompt: list[int] | None = None) -> TokenSequence:
    seq = TokenSequence(
        request_id="r",
        prompt_token_ids=prompt or [1, 2, 3],
        params=params,
        eos_token_ids=frozenset({0}),
        max_total_tokens=1000,
    )
    seq.status = SequenceStatus.RUNNING
    return seq


def _verify_step(seq: TokenSequence, drafts: tuple[int, ...]) -> SchedulerOutput:
    entry = ScheduledSequence(seq, 1 + len(drafts), samples=True, draft_token_ids=drafts)
    return SchedulerOutput(scheduled=[entry])


def test_a_stop_token_among_accepted_drafts_is_the_last_token() -> None:
    seq = _running(SamplingParams(max_tokens=50, stop_token_ids=[9]))
    out = _verify_step(seq, (5, 9, 6))
    stats = SpecDecodeStats(4)
    result = SamplerOutput(token_ids=[7], num_accepted=[3])
    drafts = accept_drafts(out, result, stats)
    append_sampled(out, result, drafts.ended)
    assert seq.output_token_ids == [5, 9]  # not 6, nor the step's own token 7
    assert seq.check_stop_token() == "stop"
    assert (drafts.appended, drafts.ended) == ({"r": 2}, frozenset({"r"}))
    assert out.scheduled[0].num_accepted == 2
    # Statistics count what the verification accepted.
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 3)
    assert stats.accepted_per_position == (1, 1, 1, 0)


def test_without_a_stop_the_accepted_drafts_come_before_the_token() -> None:
    seq = _running(SamplingParams(max_tokens=50))
    out = _verify_step(seq, (5, 8, 6))
    result = SamplerOutput(token_ids=[7], num_accepted=[1])
    drafts = accept_drafts(out, result, SpecDecodeStats(3))
    append_sampled(out, result, drafts.ended)
    assert seq.output_token_ids == [5, 7]
    assert drafts.ended == frozenset()


def test_a_stop_string_inside_an_accepted_run_drops_the_tokens_after_it(demo_dir: Path) -> None:
    tokenizer = Tokenizer(demo_dir)
    words = tokenizer.encode("one two three four")
    stop_at = tokenizer.decode(words[:2])
    seq = _running(SamplingParams(max_tokens=50, stop=[stop_at[-3:]]), prompt=[1])
    processor = OutputProcessor(tokenizer)
    processor.add(seq)
    seq.token_ids += words
    assert processor.on_tokens(seq, len(words)) == "stop"
    assert seq.output_token_ids == words[:2]
    assert processor.make_output(seq).text == stop_at[:-3]


def test_only_verified_tokens_count_as_computed_and_rejected_blocks_go_back() -> None:
    blocks = BlockManager(num_blocks=16, block_size=4, enable_prefix_cache=True)
    scheduler = Scheduler(SchedulerConfig(), blocks)
    seq = _running(SamplingParams(max_tokens=50), prompt=[1, 2, 3, 4, 5, 6, 7])
    scheduler.running.append(seq)
    blocks.allocate(seq, 7, cached=[])
    seq.num_computed_tokens = 7
    seq.token_ids.append(8)  # sampled by the prefill; the decode computes it
    # Token 8 and six drafts: positions 7..13, four blocks.
    blocks.append_slots(seq, 7)
    assert len(seq.block_table) == 4
    out = _verify_step(seq, (9, 10, 11, 12, 13, 14))
    result = SamplerOutput(token_ids=[20], num_accepted=[1])
    accept_drafts(out, result, SpecDecodeStats(6))
    scheduler.on_step_done(out)
    append_sampled(out, result)
    assert seq.num_computed_tokens == 9  # 8 and the accepted 9; 20 has no KV yet
    assert seq.token_ids[7:] == [8, 9, 20]
    # Blocks for positions 0..9 stay (the next step writes 20's KV at position 9).
    assert len(seq.block_table) == 3 and blocks.num_free_blocks == 13
    # Only the full blocks of verified tokens are cached: positions 0..7.
    assert len(seq.block_hashes) == 2
