"""Which decoding sequences get draft tokens this step, and how many.

A sequence gets none when its sampling needs state that the verify step cannot apply
position by position (a grammar, logits processors such as penalties, min_tokens, logit_bias
or min_p, prompt logprobs still to score): with no drafts its step is the plain one, so
speculation stays lossless by construction. Logprobs are no obstacle: each accepted draft's
come from its own position's logits, as the plain step's would. Drafts never run past what
the request may still emit (max_tokens, the context) nor past the step's token budget.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tandem.core.config import SpeculativeConfig
from tandem.core.llm.ngram_proposer import NgramProposer
from tandem.core.llm.sequence import TokenSequence


class Drafter:
    def __init__(
        self, config: SpeculativeConfig, uses_processor: Callable[[TokenSequence], bool]
    ) -> None:
        """``uses_processor``: whether a sequence's sampling uses some logits processor."""
        self.config = config
        self._propose = _head_drafts
        if not config.drafts_with_head:
            proposer = NgramProposer(config)
            self._propose = lambda seq, room: proposer.propose(seq.token_ids, room)
        self._uses_processor = uses_processor

    def may_draft(self, seq: TokenSequence) -> bool:
        # A sequence with prompt logprobs still to score is in its prefill's last step.
        return (
            seq.grammar is None and not seq.needs_prompt_logprobs and not self._uses_processor(seq)
        )

    def drafts(self, seq: TokenSequence, budget: int) -> tuple[int, ...]:
        """Draft tokens for ``seq``'s next decode, which has ``budget`` tokens of the step's
        budget left (its own next token included)."""
        # The step emits at most drafts + 1 tokens: no more than the request may still emit.
        room = min(budget, seq.max_output_tokens - seq.num_output_tokens) - 1
        if room <= 0 or not self.may_draft(seq):
            return ()
        return tuple(self._propose(seq, room))


def _head_drafts(seq: TokenSequence, room: int) -> Sequence[int]:
    """The multi-token-prediction head's drafts, made by the worker in the step that
    sampled the sequence's last token (``SamplerOutput.draft_token_ids``): none when the
    sequence has other tokens since. A preempted sequence asks again only after its
    recomputed prefill has sampled, which drafts anew."""
    if seq.head_drafts_at != len(seq.token_ids):
        return ()
    return seq.head_drafts[:room]
