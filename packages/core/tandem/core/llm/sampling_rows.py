"""The engine thread's side of the logits processors' batch state: which slot each sequence
holds, and the changes each step carries to the sampling worker (``logits_processor.py``).

A sequence takes a slot when it first samples in a step (again after a preemption), if some
processor uses its parameters; a sequence without any keeps none and costs nothing. Slots
are freed (``BatchUpdate.removed``) only in a step built with no other step in flight, and a
slot freed there is taken again in that same step or after the next such step: pipeline lanes
may run their steps in any order, and a freed slot must not be reset by a late removal, nor
counted into by a step that still named its old sequence.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from tandem.core.llm.logits_processor import AddedRow, BatchUpdate, LogitsProcessor
from tandem.core.llm.logits_processors import processor_classes
from tandem.core.llm.sequence import SequenceStatus, TokenSequence


class SamplingRows:
    def __init__(
        self, max_rows: int, classes: Sequence[type[LogitsProcessor]] | None = None
    ) -> None:
        self.max_rows = max_rows
        self._classes = tuple(processor_classes() if classes is None else classes)
        # id(seq) -> (seq, slot, preemptions when it took the slot).
        self._held: dict[int, tuple[TokenSequence, int, int]] = {}
        self._free: list[int] = []  # a heap: the lowest free slot first
        self._next = 0
        # Freed in a step that may still run beside later ones: free after the next lone one.
        self._quarantined: list[int] = []

    @property
    def num_held(self) -> int:
        return len(self._held)

    def uses_processor(self, seq: TokenSequence) -> bool:
        return any(cls.uses(seq.params) for cls in self._classes)

    def assign(
        self, seqs: Sequence[TokenSequence], alone: bool
    ) -> tuple[torch.Tensor | None, BatchUpdate | None]:
        """The slot of each of ``seqs`` (the step's sampled rows, in order) and the update
        the step carries. ``alone``: no other step is in flight while this one is built.
        Nothing changes here unless it returns."""
        held = dict(self._held)
        free = list(self._free)
        quarantined = list(self._quarantined)
        removed: list[int] = []
        if alone:
            # Every step built before this one has completed: what they freed is free.
            for slot in quarantined:
                heapq.heappush(free, slot)
            quarantined = []
            for key, (seq, slot, preemptions) in self._held.items():
                # A preempted sequence resumes with a slot taken afresh.
                if seq.status is not SequenceStatus.RUNNING or seq.num_preemptions != preemptions:
                    del held[key]
                    removed.append(slot)
        # Removed in this step, which applies its removals before its additions: free for
        # those, and for later steps only once this one has run (the next lone step).
        reusable = sorted(removed, reverse=True)
        next_slot = self._next
        slots: list[int] = []
        added: list[AddedRow] = []
        for seq in seqs:
            entry = held.get(id(seq))
            if entry is not None:
                slots.append(entry[1])
                continue
            if not self.uses_processor(seq):
                slots.append(-1)
                continue
            if reusable:
                slot = reusable.pop()
            elif free:
                slot = heapq.heappop(free)
            elif next_slot < self.max_rows:
                slot, next_slot = next_slot, next_slot + 1
            else:
                raise RuntimeError(
                    f"all {self.max_rows} logits-processor slots are held; a sampled row needs one"
                )
            held[id(seq)] = (seq, slot, seq.num_preemptions)
            added.append(self._added_row(seq, slot))
            slots.append(slot)
        self._held, self._free, self._next = held, free, next_slot
        self._quarantined = quarantined + reusable
        update = BatchUpdate(tuple(removed), tuple(added)) if removed or added else None
        if all(slot < 0 for slot in slots):
            return None, update
        return torch.tensor(slots, dtype=torch.int64), update

    def _added_row(self, seq: TokenSequence, slot: int) -> AddedRow:
        params = seq.params
        using = [cls for cls in self._classes if cls.uses(params) and cls.needs_token_ids(params)]
        reading = [cls for cls in using if cls.needs_prompt(params)]
        prompt: torch.Tensor | None = None
        if reading:
            prompt = torch.tensor(seq.prompt_token_ids, dtype=torch.int64)
            if not any(cls.prompt_order_matters for cls in reading):
                prompt = torch.unique(prompt)
        return AddedRow(
            slot=slot,
            params=params,
            eos_token_ids=seq.eos_token_ids,
            num_output_tokens=seq.num_output_tokens,
            prompt_token_ids=prompt,
            output_token_ids=(
                torch.tensor(seq.output_token_ids, dtype=torch.int64) if using else None
            ),
        )
