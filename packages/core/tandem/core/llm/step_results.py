"""A completed step's ``SamplerOutput`` written into its sequences: sampled tokens, their
logprobs and the prompt's, grammars advanced."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tandem.core.llm.forward_input import PromptLogprobs, SamplerOutput
from tandem.core.llm.scheduler import SchedulerOutput
from tandem.core.llm.sequence import SequenceStatus, TokenLogprobs, TokenSequence
from tandem.core.llm.spec_decode_stats import SpecDecodeStats

logger = logging.getLogger(__name__)


def append_sampled(
    sched_out: SchedulerOutput, result: SamplerOutput, ended: frozenset[str] = frozenset()
) -> list[tuple[TokenSequence, int]]:
    """Append each running sequence's sampled token; the sequences and their rows of
    ``result`` (a sequence aborted while the step ran keeps its row, unused). ``ended``:
    requests whose accepted drafts already ended them (``accept_drafts``), which take no
    more tokens but keep their rows."""
    sampled: list[tuple[TokenSequence, int]] = []
    row = 0
    for entry in sched_out.scheduled:
        if not entry.samples:
            continue
        seq = entry.seq
        if seq.status is SequenceStatus.RUNNING:
            if seq.request_id not in ended:
                seq.token_ids.append(result.token_ids[row])
                if result.draft_token_ids is not None:
                    # The head drafted what follows the token just appended.
                    seq.head_drafts = tuple(result.draft_token_ids[row])
                    seq.head_drafts_at = len(seq.token_ids)
            sampled.append((seq, row))
        row += 1
    return sampled


def failed_rows(
    sched_out: SchedulerOutput, result: SamplerOutput
) -> list[tuple[TokenSequence, str]]:
    """The running sequences whose row a logits processor failed, each with why."""
    if not result.failed:
        return []
    failed: list[tuple[TokenSequence, str]] = []
    row = 0
    for entry in sched_out.scheduled:
        if not entry.samples:
            continue
        message = result.failed.get(row)
        row += 1
        if message is not None and entry.seq.status is SequenceStatus.RUNNING:
            failed.append((entry.seq, message))
    return failed


@dataclass
class AcceptedDrafts:
    """What a step's verification kept: drafts appended per request, and the requests that
    one of them ended (a stop token, or the length)."""

    appended: dict[str, int] = field(default_factory=dict)
    ended: frozenset[str] = frozenset()


def accept_drafts(
    sched_out: SchedulerOutput, result: SamplerOutput, stats: SpecDecodeStats
) -> AcceptedDrafts:
    """Append each running sequence's accepted drafts, before the scheduler advances it
    (they are computed tokens: ``Scheduler.on_step_done``), and count them in ``stats``.
    A draft that ends the request (a stop token, the length) is its last token: nothing
    after it is emitted, not even an accepted draft or the step's token."""
    out = AcceptedDrafts()
    if result.num_accepted is None:
        return out
    ended: set[str] = set()
    row = 0
    for entry in sched_out.scheduled:
        if not entry.samples:
            continue
        accepted = result.num_accepted[row]
        row += 1
        seq = entry.seq
        if not entry.draft_token_ids or seq.status is not SequenceStatus.RUNNING:
            continue
        stats.record(len(entry.draft_token_ids), accepted)
        kept = 0
        for token in entry.draft_token_ids[:accepted]:
            seq.token_ids.append(token)
            _record_draft_logprobs(seq, row - 1, kept, result)
            kept += 1
            if seq.check_stop_token() is not None:
                ended.add(seq.request_id)
                break
        entry.num_accepted = kept
        out.appended[seq.request_id] = kept
    out.ended = frozenset(ended)
    return out


def _record_draft_logprobs(seq: TokenSequence, row: int, k: int, result: SamplerOutput) -> None:
    """The logprobs of ``seq``'s ``k``-th accepted draft (its newest token), if it asked."""
    if seq.params.logprobs is None or result.accepted_logprobs is None:
        return
    assert result.accepted_top_token_ids is not None
    assert result.accepted_top_logprobs is not None
    _append_logprobs(
        seq,
        result.accepted_logprobs[row][k],
        result.accepted_top_token_ids[row][k],
        result.accepted_top_logprobs[row][k],
    )


def record_logprobs(seq: TokenSequence, row: int, result: SamplerOutput) -> None:
    """The logprobs of ``seq``'s newest token, if it asked for them."""
    if seq.params.logprobs is None or result.logprobs is None:
        return
    assert result.top_token_ids is not None and result.top_logprobs is not None
    _append_logprobs(seq, result.logprobs[row], result.top_token_ids[row], result.top_logprobs[row])


def _append_logprobs(
    seq: TokenSequence, logprob: float, top_ids: list[int], top_values: list[float]
) -> None:
    n = seq.params.logprobs
    top = list(zip(top_ids[:n], top_values[:n], strict=True))
    seq.logprobs.append(TokenLogprobs(token_id=seq.token_ids[-1], logprob=logprob, top=top))


def advance_grammar(seq: TokenSequence, token: int) -> str | None:
    """Feed the sampled token to the request's grammar; a finish reason once the grammar is
    complete (nothing but EOS may follow) or broken."""
    assert seq.grammar is not None
    if not seq.grammar.accept(token):
        seq.error = f"the output left its grammar at token {token}: {seq.grammar.error}"
        if seq.grammar.broken:
            seq.error_param = seq.grammar.param
            seq.error = (
                f"the grammar of {seq.grammar.param} went past the grammar engine's limits "
                f"at output token {len(seq.output_token_ids)}: {seq.grammar.error}; simplify it"
            )
        logger.warning("request %s: %s", seq.request_id, seq.error)
        return "error"
    return "stop" if seq.grammar.is_finished else None


def record_prompt_logprobs(sched_out: SchedulerOutput, scored: PromptLogprobs) -> None:
    at = 0
    for index, first, count in scored.spans:
        seq = sched_out.scheduled[index].seq
        # Equal unless the step raced an abort; never record a position twice.
        if first == len(seq.prompt_logprobs):
            n = seq.params.prompt_logprobs or 0
            seq.prompt_logprobs.extend(
                TokenLogprobs(
                    token_id=seq.prompt_token_ids[first + k],
                    logprob=scored.logprobs[at + k],
                    top=list(
                        zip(
                            scored.top_token_ids[at + k][:n],
                            scored.top_logprobs[at + k][:n],
                            strict=True,
                        )
                    ),
                    rank=scored.ranks[at + k],
                )
                for k in range(count)
            )
        at += count
