"""Speculative decoding's counters since start, as vLLM reports them: verify rows
(``num_drafts``), draft tokens proposed, drafts accepted, and accepted per draft position."""

from __future__ import annotations


class SpecDecodeStats:
    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self._per_position = [0] * num_speculative_tokens

    @property
    def accepted_per_position(self) -> tuple[int, ...]:
        return tuple(self._per_position)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """A row that verified ``num_drafts`` drafts and accepted the first ``num_accepted``."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self._per_position[position] += 1
