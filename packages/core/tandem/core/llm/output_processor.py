"""Per-request text state: incremental detokenization, stop strings and streamed deltas.

Text that could still turn out to be the start of a stop string is held back until it is
known not to be, so a stop string is never sent, not even in part.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tandem.core.llm.detokenizer import IncrementalDetokenizer
from tandem.core.llm.outputs import RequestOutput
from tandem.core.llm.sequence import TokenSequence
from tandem.core.llm.tokenizer import Tokenizer


@dataclass
class RequestState:
    seq: TokenSequence
    detokenizer: IncrementalDetokenizer
    text: str = ""
    emitted_text: int = 0
    emitted_tokens: int = 0
    emitted_logprobs: int = 0
    stop_reason: str | int | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add(self, seq: TokenSequence) -> None:
        self.states[seq.request_id] = RequestState(
            seq=seq, detokenizer=IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids)
        )

    def on_tokens(self, seq: TokenSequence, count: int) -> str | None:
        """``on_token`` for each of the newest ``count`` tokens (a step that accepted
        drafts adds several), in order; a stop string in one drops the tokens after it."""
        if count == 1:
            return self.on_token(seq)
        first = len(seq.token_ids) - count + 1
        pending = seq.token_ids[first:]
        del seq.token_ids[first:]
        reason = self.on_token(seq)
        for token in pending:
            if reason is not None:
                break
            seq.token_ids.append(token)
            reason = self.on_token(seq)
        return reason

    def on_token(self, seq: TokenSequence) -> str | None:
        """Account for the newest token; returns a finish reason if the text hit a stop."""
        state = self.states[seq.request_id]
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = time.monotonic()
        seq.metrics.last_token_time = time.monotonic()
        token = seq.token_ids[-1]
        if token in seq.params.stop_token_ids:
            state.stop_reason = token
        added = state.detokenizer.add(token)
        # As in vLLM, stop strings count only once min_tokens are out.
        if not added or not seq.params.stop or seq.num_output_tokens <= seq.params.min_tokens:
            state.text += added
            return None
        # Only the region the new text touches can hold a newly completed stop string.
        longest = max(len(s) for s in seq.params.stop)
        search_from = max(len(state.text) - longest + 1, 0)
        state.text += added
        best: tuple[int, str] | None = None
        for stop in seq.params.stop:
            at = state.text.find(stop, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        end = best[0] + len(best[1]) if seq.params.include_stop_str_in_output else best[0]
        state.text = state.text[:end]
        state.stop_reason = best[1]
        return "stop"

    def make_output(self, seq: TokenSequence) -> RequestOutput:
        state = self.states[seq.request_id]
        finished = seq.is_finished
        if (
            finished
            and seq.finish_reason in ("length", "stop")
            and not isinstance(state.stop_reason, str)
        ):
            state.text += state.detokenizer.flush()
        upto = len(state.text)
        if not finished and seq.params.stop and not seq.params.include_stop_str_in_output:
            # Hold back a tail that may still grow into a stop string (sent anyway with
            # include_stop_str_in_output, so held back for nothing).
            upto = max(state.emitted_text, upto - max(len(s) for s in seq.params.stop) + 1)
        delta = state.text[state.emitted_text : upto]
        state.emitted_text = upto
        new_tokens = seq.output_token_ids[state.emitted_tokens :]
        state.emitted_tokens += len(new_tokens)
        new_logprobs = seq.logprobs[state.emitted_logprobs :]
        state.emitted_logprobs += len(new_logprobs)
        if finished:
            del self.states[seq.request_id]
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            text=state.text[:upto],
            new_token_ids=new_tokens,
            delta_text=delta,
            finished=finished,
            finish_reason=seq.finish_reason,
            stop_reason=state.stop_reason,
            error=seq.error,
            error_param=seq.error_param,
            logprobs=seq.logprobs if seq.params.logprobs is not None else None,
            new_logprobs=new_logprobs,
            prompt_logprobs=seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None,
            num_cached_tokens=seq.num_cached_prompt_tokens,
            metrics=seq.metrics,
        )
