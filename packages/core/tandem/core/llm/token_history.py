"""One sequence's tokens as tensors, for the penalties.

The engine thread keeps each penalized sequence's tokens as tensors that grow with the
output, so a step's penalty batch is a concatenation, not a conversion of every token list.
A module of its own because the sequence holds one and the penalty batch reads it; the
batch builder also reads the sequence.
"""

from __future__ import annotations

import torch


class TokenHistory:
    """One sequence's distinct prompt tokens and its output tokens, as int64 tensors."""

    def __init__(self, prompt_token_ids: list[int]) -> None:
        self.prompt = torch.tensor(sorted(set(prompt_token_ids)), dtype=torch.int64)
        self._output = torch.empty(64, dtype=torch.int64)
        self._size = 0

    def output(self, output_token_ids: list[int]) -> torch.Tensor:
        """The output tokens, after appending those of ``output_token_ids`` not seen yet."""
        total = len(output_token_ids)
        if total > self._size:
            if total > self._output.numel():
                grown = torch.empty(max(total, 2 * self._output.numel()), dtype=torch.int64)
                grown[: self._size] = self._output[: self._size]
                self._output = grown
            self._output[self._size : total] = torch.tensor(
                output_token_ids[self._size :], dtype=torch.int64
            )
            self._size = total
        return self._output[:total]
