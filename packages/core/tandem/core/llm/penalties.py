"""Repetition, frequency and presence penalties, as a logits processor.

Definitions follow vLLM (and, for repetition, transformers' RepetitionPenaltyLogitsProcessor):
a token seen in the prompt or the output has its logit divided by ``repetition_penalty`` when
positive and multiplied when negative; a token generated ``c`` times loses
``frequency_penalty * c + presence_penalty * (c > 0)`` (the output only, not the prompt).

Each slot keeps, on the device, how often each token was generated and which tokens its
prompt holds: filled once when a row is added (from the tokens it has, so a preempted
request resumes where it was), then counted up from the tokens each step samples, on the
device (no host sync, nothing rebuilt from token lists per step). Allocated on the first
penalized row, so an engine that never sees one holds nothing.
"""

from __future__ import annotations

import numpy as np
import torch

from tandem.core.llm.logits_processor import (
    AddedRow,
    LogitsProcessor,
    ProcessorContext,
    StepRows,
)
from tandem.core.llm.sampling_params import SamplingParams


class Penalties(LogitsProcessor):
    _counts: torch.Tensor | None = None  # [max_rows, V] float32 times generated
    _prompt_seen: torch.Tensor | None = None  # [max_rows, V] bool

    def __init__(self, ctx: ProcessorContext) -> None:
        super().__init__(ctx)
        rows = self.ctx.max_rows
        self._presence = np.zeros(rows, dtype=np.float32)
        self._frequency = np.zeros(rows, dtype=np.float32)
        self._repetition = np.ones(rows, dtype=np.float32)

    @classmethod
    def uses(cls, params: SamplingParams) -> bool:
        return params.has_penalties

    @classmethod
    def needs_token_ids(cls, params: SamplingParams) -> bool:
        return True

    @classmethod
    def needs_prompt(cls, params: SamplingParams) -> bool:
        # Only the repetition penalty looks at the prompt, and only at which tokens it holds.
        return params.repetition_penalty != 1.0

    prompt_order_matters = False

    def add(self, slot: int, row: AddedRow) -> None:
        params = row.params
        self._presence[slot] = params.presence_penalty
        self._frequency[slot] = params.frequency_penalty
        self._repetition[slot] = params.repetition_penalty
        if self._counts is None or self._prompt_seen is None:
            shape = (self.ctx.max_rows, self.ctx.vocab_size)
            self._counts = torch.zeros(shape, dtype=torch.float32, device=self.ctx.device)
            self._prompt_seen = torch.zeros(shape, dtype=torch.bool, device=self.ctx.device)
        assert row.output_token_ids is not None
        device = self.ctx.device
        counts = self._counts[slot]
        counts.zero_()
        outputs = row.output_token_ids.to(device)
        counts.index_put_((outputs,), torch.ones(outputs.numel(), device=device), accumulate=True)
        seen = self._prompt_seen[slot]
        seen.zero_()
        if row.prompt_token_ids is not None:
            seen[row.prompt_token_ids.to(device)] = True

    def apply(self, logits: torch.Tensor, rows: StepRows) -> torch.Tensor:
        assert self._counts is not None and self._prompt_seen is not None
        device = logits.device
        index = rows.rows_on(device)
        slots = rows.slots_on(device)
        sub = logits[index]
        counts = self._counts[slots]
        generated = counts > 0
        seen = generated | self._prompt_seen[slots]
        repetition = torch.from_numpy(self._repetition[rows.slots]).to(device).unsqueeze(1)
        frequency = torch.from_numpy(self._frequency[rows.slots]).to(device).unsqueeze(1)
        presence = torch.from_numpy(self._presence[rows.slots]).to(device).unsqueeze(1)
        penalized = torch.where(sub > 0, sub / repetition, sub * repetition)
        sub = torch.where(seen, penalized, sub)
        sub = sub - frequency * counts
        sub = sub - presence * generated.to(sub.dtype)
        logits[index] = sub
        return logits

    def on_sampled(self, rows: StepRows, tokens: torch.Tensor) -> None:
        assert self._counts is not None
        device = tokens.device
        index = rows.rows_on(device)
        self._counts.index_put_(
            (rows.slots_on(device), tokens[index]),
            torch.ones(len(rows.rows), device=device),
            accumulate=True,
        )
