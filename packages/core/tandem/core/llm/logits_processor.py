"""The logits-processor interface: a sampling parameter is one class that keeps its own state
per batch row, told how the batch changes at each step.

Rows and slots. The engine thread gives each sequence that uses some processor a *slot* when
it first samples, keeps it while the sequence runs, and frees it once the sequence finished or
was preempted (``sampling_rows.py``); a step names the slot of each row it samples
(``SamplingBatch.slots``, -1 for rows no processor uses) and carries the batch's changes since
the last step (``BatchUpdate``: slots removed, then slots added with the request's
``SamplingParams`` and tokens). A processor keeps its state indexed by slot, on the device or
on the host, allocated once per engine and reset row by row, never rebuilt from the
sequences' token lists per step. Rows never move: pipeline lanes run steps concurrently, and
a slot stays what a step built before a move named it (a gather by slot costs what the
gather by row of the old per-step batches cost). A freed slot is reused only by a step built
after every step that could still name it has completed.

Where it runs. The processors live beside the sampler on the worker that samples (rank 0),
one set per worker, shared by its pipeline lanes: every call into them (update, apply,
on_sampled) holds one lock, so a lane never sees another's half-made change. The sampler
applies each step's update before its logits, exactly once, also on a step that samples no
row.

Order. Processors run in registry order (``logits_processors.processor_classes``): those
with ``after_temperature`` False on the logits before temperature (after a grammar's mask),
the others on the temperature-scaled logits of rows that sample randomly (greedy rows take
the argmax before them, so they must leave it alone).

Failures. A processor that raises fails the requests whose rows it serves, never the step
(``processor_failures.py``): ``apply`` is taken to be a pure edit of the logits (the sampler
samples the step again without a processor that raised in it), and state changes belong in
``add``, ``remove`` and ``on_sampled``.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from tandem.core.llm.processor_failures import failure_message

if TYPE_CHECKING:
    from tandem.core.llm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcessorContext:
    """What a processor is built from, once per engine on the sampling worker."""

    vocab_size: int  # the logits' width
    device: torch.device
    max_rows: int  # slots a batch holds at most (the scheduler's max_seqs_per_batch)


@dataclass(frozen=True)
class AddedRow:
    """A sequence that takes ``slot`` from this step on."""

    slot: int
    params: SamplingParams
    eos_token_ids: frozenset[int]
    # Output tokens the sequence has already (more than 0 after a preemption).
    num_output_tokens: int
    # int64, given only when a processor the row uses asks for them (``needs_token_ids``;
    # the prompt only if one also ``needs_prompt``, and as its distinct tokens when none of
    # those needs its order: the step carries every added row's prompt to the sampling
    # worker, across processes too); the step's own copies (work handed to another thread
    # owns its inputs).
    prompt_token_ids: torch.Tensor | None = None
    output_token_ids: torch.Tensor | None = None


@dataclass(frozen=True)
class BatchUpdate:
    """The batch's changes before a step: ``removed`` slots are applied before ``added``."""

    removed: tuple[int, ...] = ()
    added: tuple[AddedRow, ...] = ()


@dataclass(frozen=True)
class StepRows:
    """The rows of one step that a processor serves: their indices in the step's logits and
    their slots (both host arrays, decided without looking at the device)."""

    rows: np.ndarray  # [R] int64 indices into the step's sampled rows
    slots: np.ndarray  # [R] int64
    num_rows: int  # rows the step samples (the logits' height)

    @property
    def is_all(self) -> bool:
        return len(self.rows) == self.num_rows

    def rows_on(self, device: torch.device) -> torch.Tensor:
        return torch.from_numpy(self.rows).to(device)

    def slots_on(self, device: torch.device) -> torch.Tensor:
        return torch.from_numpy(self.slots).to(device)


class LogitsProcessor(ABC):
    """One sampling parameter. Subclasses say which requests use it (``uses``), check its
    value (``validate``), keep their rows' state (``add``, ``remove``) and edit logits
    (``apply``); ``on_sampled`` sees each step's tokens. The base class keeps which slots use
    the processor, so ``apply`` is only called on steps where some row does."""

    # Applied to the temperature-scaled logits of randomly sampled rows (min_p) instead of
    # to the logits before temperature.
    after_temperature: ClassVar[bool] = False
    # Names of the request fields this processor reads from ``SamplingParams.extra`` (a
    # parameter of a plugin, which has no field of its own in SamplingParams); the server
    # copies these from the request body.
    extra_params: ClassVar[tuple[str, ...]] = ()

    def __init__(self, ctx: ProcessorContext) -> None:
        self.ctx = ctx
        self.active = np.zeros(ctx.max_rows, dtype=bool)

    @classmethod
    @abstractmethod
    def uses(cls, params: SamplingParams) -> bool:
        """Whether a request with ``params`` needs this processor at all."""

    @classmethod
    def validate(cls, params: SamplingParams) -> None:
        """InvalidRequestError (a 400 at the API) if the request's value is out of range."""
        return None

    @classmethod
    def needs_token_ids(cls, params: SamplingParams) -> bool:
        """Whether ``add`` needs the row's prompt and output tokens."""
        return False

    @classmethod
    def needs_prompt(cls, params: SamplingParams) -> bool:
        """Whether ``add`` reads the prompt too (with ``needs_token_ids``)."""
        return cls.needs_token_ids(params)

    # Whether the prompt must come in order; False: its distinct tokens, sorted, suffice.
    prompt_order_matters: ClassVar[bool] = True

    @abstractmethod
    def add(self, slot: int, row: AddedRow) -> None:
        """Take ``slot`` for ``row``: reset whatever the slot held before."""

    def remove(self, slot: int) -> None:
        """``slot`` is no longer used (its state may be left as it is)."""
        return None

    @abstractmethod
    def apply(self, logits: torch.Tensor, rows: StepRows) -> torch.Tensor:
        """``logits`` [S, V] float32 (the step's own) with ``rows`` edited, in place or new."""

    def on_sampled(self, rows: StepRows, tokens: torch.Tensor) -> None:
        """The step sampled ``tokens`` [S] (on the device; the rows' next output tokens)."""
        return None

    # -- bookkeeping, called by LogitsProcessors -------------------------------------------

    def update_state(self, update: BatchUpdate) -> dict[int, str]:
        """Apply ``update``; the added slots this processor failed to take (``uses`` or
        ``add`` raised), each with why (left inactive here). A ``remove`` that raises is
        logged and passed over: its row has left the batch, and ``add`` resets the slot."""
        for slot in update.removed:
            if self.active[slot]:
                self.active[slot] = False
                try:
                    self.remove(slot)
                except Exception:
                    logger.exception("%s failed to remove slot %d", type(self).__qualname__, slot)
        failed: dict[int, str] = {}
        # Per added row (once per sequence, not per step): one row's bad value fails only it.
        for row in update.added:
            try:
                used = self.uses(row.params)
                if self.active[row.slot] and not used:
                    self.remove(row.slot)
                self.active[row.slot] = used
                if used:
                    self.add(row.slot, row)
            except Exception as exc:
                logger.exception("%s failed to add slot %d", type(self).__qualname__, row.slot)
                self.active[row.slot] = False
                failed[row.slot] = failure_message(self, "add", exc)
        return failed

    def rows_of(self, slots: np.ndarray) -> StepRows | None:
        """This step's rows that use the processor; None when none does."""
        mask = slots >= 0
        mask[mask] = self.active[slots[mask]]
        rows = np.flatnonzero(mask)
        if len(rows) == 0:
            return None
        return StepRows(rows=rows, slots=slots[rows], num_rows=len(slots))


def grow_rows(array: np.ndarray, width: int, fill: float) -> np.ndarray:
    """``array`` [rows, k] widened to ``width`` columns (at least doubled), padded with
    ``fill``: per-slot host state whose width is the largest row's."""
    if width <= array.shape[1]:
        return array
    grown = np.full((array.shape[0], max(width, 2 * array.shape[1])), fill, dtype=array.dtype)
    grown[:, : array.shape[1]] = array
    return grown
