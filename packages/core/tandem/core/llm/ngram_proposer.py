"""N-gram (prompt lookup) drafts: the tokens that followed the longest suffix n-gram of a
sequence where it occurred before, as vLLM's ``NgramProposer`` picks them.

The search is a few numpy array operations over the sequence, on the engine's thread beside
the step: every earlier position holding the sequence's last token is a candidate end of a
match, and the match length of all candidates is taken at once by comparing up to
``prompt_lookup_max`` tokens back from each (a [candidates, n] comparison, then the length of
each row's leading run of equal tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tandem.core.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.max_n = config.prompt_lookup_max
        self.min_n = config.prompt_lookup_min
        self.k = config.num_speculative_tokens

    def propose(self, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        """Up to ``min(k, max_drafts)`` tokens that followed the longest n-gram (``max_n``
        down to ``min_n`` tokens) ending at an earlier position and equal to the sequence's
        suffix; of several equally long, the earliest (vLLM's choice). Fewer when the
        sequence ends before, none without a match."""
        k = min(self.k, max_drafts)
        length = len(token_ids)
        if k <= 0 or length <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        # Candidate ends of an earlier occurrence: the suffix itself (at length - 1) is not.
        ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
        ends = ends[ends >= self.min_n - 1]
        if ends.size == 0:
            return []
        back = np.arange(self.max_n)
        # Compare tokens[end - j] with tokens[length - 1 - j] for j < max_n; before the
        # sequence's start there is nothing to match (index -1 marks it).
        at = ends[:, None] - back[None, :]
        valid = at >= 0
        earlier = np.where(valid, tokens[np.maximum(at, 0)], -1)
        suffix = tokens[length - 1 - back]
        equal = (earlier == suffix[None, :]) & valid
        # The leading run of equal tokens in each row: its match length.
        match_len = np.where(equal.all(axis=1), self.max_n, np.argmin(equal, axis=1))
        best = int(match_len.max())
        if best < self.min_n:
            return []
        # argmax gives the first (earliest) candidate of the longest length.
        start = int(ends[int(np.argmax(match_len == best))]) + 1
        return [int(t) for t in tokens[start : start + k]]
