"""The logits processors every engine runs, the registry that lists them with the plugins'
(entry point group ``tandem.logits_processors``), and the set one sampling worker holds.

Order, as vLLM applies them: the grammar's allowed tokens first, then min_tokens' banned stop
tokens and logit_bias, then the penalties; min_p after temperature. The grammar's mask is not
a processor: its matchers live on the engine thread, which advances them with each token it
accepts and fills the step's bitmask there (``structured_output.py``); what reaches the
sampler is that step's mask, not state of its own.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from importlib.metadata import entry_points

import numpy as np
import torch

from tandem.core.errors import InvalidRequestError
from tandem.core.llm.forward_input import GrammarMasks, SamplingBatch
from tandem.core.llm.logits_processor import (
    AddedRow,
    LogitsProcessor,
    ProcessorContext,
    StepRows,
    grow_rows,
)
from tandem.core.llm.penalties import Penalties
from tandem.core.llm.processor_failures import FailedSlots, ProcessorFailed, failure_message
from tandem.core.llm.sampling_params import SamplingParams
from tandem.device.sync import LockLike

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "tandem.logits_processors"


def add_at_tokens(
    logits: torch.Tensor, rows: StepRows, tokens: np.ndarray, values: np.ndarray
) -> torch.Tensor:
    """``values`` [rows, K] added, in place, to the logits of ``tokens`` [rows, K] of each of
    the step's rows (-1: no token), in one scatter."""
    valid = tokens >= 0
    index = np.broadcast_to(rows.rows[:, None], tokens.shape)[valid]
    device = logits.device
    logits.index_put_(
        (torch.from_numpy(index).to(device), torch.from_numpy(tokens[valid]).to(device)),
        torch.from_numpy(values[valid]).to(device),
        accumulate=True,
    )
    return logits


class MinTokens(LogitsProcessor):
    """EOS and the stop token ids are banned (-inf) until a row has ``min_tokens`` tokens."""

    def __init__(self, ctx: ProcessorContext) -> None:
        super().__init__(ctx)
        self._remaining = np.zeros(ctx.max_rows, dtype=np.int64)
        self._banned = np.full((ctx.max_rows, 4), -1, dtype=np.int64)

    @classmethod
    def uses(cls, params: SamplingParams) -> bool:
        return params.min_tokens > 0

    def add(self, slot: int, row: AddedRow) -> None:
        banned = sorted(row.eos_token_ids.union(row.params.stop_token_ids))
        self._banned = grow_rows(self._banned, len(banned), -1)
        self._banned[slot] = -1
        self._banned[slot, : len(banned)] = banned
        self._remaining[slot] = row.params.min_tokens - row.num_output_tokens
        if self._remaining[slot] <= 0:
            self.active[slot] = False

    def apply(self, logits: torch.Tensor, rows: StepRows) -> torch.Tensor:
        tokens = self._banned[rows.slots]
        return add_at_tokens(logits, rows, tokens, np.full(tokens.shape, -np.inf, np.float32))

    def on_sampled(self, rows: StepRows, tokens: torch.Tensor) -> None:
        self._remaining[rows.slots] -= 1
        # A row past its minimum costs nothing from now on.
        self.active[rows.slots[self._remaining[rows.slots] <= 0]] = False


class LogitBias(LogitsProcessor):
    """A value added to the logits of chosen tokens."""

    def __init__(self, ctx: ProcessorContext) -> None:
        super().__init__(ctx)
        self._tokens = np.full((ctx.max_rows, 4), -1, dtype=np.int64)
        self._values = np.zeros((ctx.max_rows, 4), dtype=np.float32)

    @classmethod
    def uses(cls, params: SamplingParams) -> bool:
        return bool(params.logit_bias)

    def add(self, slot: int, row: AddedRow) -> None:
        bias = row.params.logit_bias
        self._tokens = grow_rows(self._tokens, len(bias), -1)
        self._values = grow_rows(self._values, len(bias), 0.0)
        self._tokens[slot] = -1
        self._tokens[slot, : len(bias)] = list(bias.keys())
        self._values[slot, : len(bias)] = list(bias.values())

    def apply(self, logits: torch.Tensor, rows: StepRows) -> torch.Tensor:
        return add_at_tokens(logits, rows, self._tokens[rows.slots], self._values[rows.slots])


class MinP(LogitsProcessor):
    """Drop tokens less likely than ``min_p`` times the row's most likely token (after
    temperature)."""

    after_temperature = True

    def __init__(self, ctx: ProcessorContext) -> None:
        super().__init__(ctx)
        self._min_p = np.zeros(ctx.max_rows, dtype=np.float32)

    @classmethod
    def uses(cls, params: SamplingParams) -> bool:
        return params.min_p > 0 and not params.is_greedy

    def add(self, slot: int, row: AddedRow) -> None:
        self._min_p[slot] = row.params.min_p

    def apply(self, logits: torch.Tensor, rows: StepRows) -> torch.Tensor:
        # Over every row (0 keeps a row whole), as one op over the batch.
        min_p = np.zeros(rows.num_rows, dtype=np.float32)
        min_p[rows.rows] = self._min_p[rows.slots]
        return apply_min_p(logits, torch.from_numpy(min_p))


# Application order: min_tokens' bans and logit_bias add to the logits in one pass each, the
# penalties read the result (a biased logit's sign decides the repetition penalty's way).
BUILTIN_PROCESSORS: tuple[type[LogitsProcessor], ...] = (MinTokens, LogitBias, Penalties, MinP)

_registry_lock = threading.Lock()
_registry: tuple[type[LogitsProcessor], ...] | None = None


def processor_classes() -> tuple[type[LogitsProcessor], ...]:
    """The built-in processors, then the installed plugins' (by entry point name)."""
    global _registry
    with _registry_lock:
        if _registry is None:
            plugins = []
            for entry in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
                cls = entry.load()
                if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
                    raise TypeError(
                        f"entry point {entry.name} = {entry.value} in {ENTRY_POINT_GROUP} is "
                        "not a LogitsProcessor subclass"
                    )
                logger.info("logits processor plugin %s (%s)", entry.name, entry.value)
                plugins.append(cls)
            _registry = BUILTIN_PROCESSORS + tuple(plugins)
        return _registry


def validate_params(params: SamplingParams) -> None:
    """Each processor's check of the request, and no extra parameter that none declares."""
    classes = processor_classes()
    known = {name for cls in classes for name in cls.extra_params}
    for name in params.extra:
        if name not in known:
            raise InvalidRequestError(
                f"unknown sampling parameter {name!r}"
                + (f"; known: {', '.join(sorted(known))}" if known else ""),
                param=name,
            )
    for cls in classes:
        cls.validate(params)


_Active = list[tuple[LogitsProcessor, StepRows]]


class LogitsProcessors:
    """The processors of one sampling worker, built once, shared by its pipeline lanes.

    A processor that raises fails the rows it serves (``processor_failures.py``): ``add``
    its added row, ``apply`` and ``on_sampled`` all its rows of the step. Those slots stay
    failed, off in every processor, until the engine removes them."""

    def __init__(
        self,
        ctx: ProcessorContext,
        lock: LockLike | None = None,
        classes: Sequence[type[LogitsProcessor]] | None = None,
    ) -> None:
        self.ctx = ctx
        chosen = processor_classes() if classes is None else classes
        self.processors = [cls(ctx) for cls in chosen]
        # A plain lock, also under the simulator: the lanes' streams that call in are not
        # simulated threads, and nothing in the processors waits on one.
        self._lock: LockLike = lock if lock is not None else threading.Lock()
        self.failed = FailedSlots()

    def prepare(self, batch: SamplingBatch) -> _Active:
        """Apply the step's batch update, then the processors some row of the step uses,
        each with its rows."""
        with self._lock:
            update = batch.update
            if update is not None:
                if self.failed:
                    self.failed.forget(update.removed)
                    self.failed.forget(row.slot for row in update.added)
                failed: dict[int, str] = {}
                for processor in self.processors:
                    for slot, message in processor.update_state(update).items():
                        failed.setdefault(slot, message)
                # After every processor took the rows: a slot one failed is off in all.
                for slot, message in failed.items():
                    self.failed.fail([slot], message, self.processors)
            if batch.slots is None:
                return []
            slots = batch.slots.numpy()
            active = []
            for processor in self.processors:
                rows = processor.rows_of(slots)
                if rows is not None:
                    active.append((processor, rows))
            return active

    def apply(self, logits: torch.Tensor, active: _Active, after_temperature: bool) -> torch.Tensor:
        """The processors' edits, in order; ProcessorFailed if one raises (or changes the
        logits' shape): the caller fails its rows and samples again without it."""
        with self._lock:
            for processor, rows in active:
                if processor.after_temperature != after_temperature:
                    continue
                try:
                    edited = processor.apply(logits, rows)
                except Exception as exc:
                    logger.exception("%s failed in apply", type(processor).__qualname__)
                    raise ProcessorFailed(
                        processor, rows, failure_message(processor, "apply", exc)
                    ) from exc
                if edited.shape != logits.shape:
                    error = ValueError(
                        f"it returned logits of shape {tuple(edited.shape)} for "
                        f"{tuple(logits.shape)}"
                    )
                    raise ProcessorFailed(
                        processor, rows, failure_message(processor, "apply", error)
                    )
                logits = edited
            return logits

    def fail(self, failure: ProcessorFailed) -> None:
        """Fail the rows of a processor whose ``apply`` raised."""
        with self._lock:
            self.failed.fail(failure.rows.slots, failure.message, self.processors)

    def on_sampled(self, active: _Active, tokens: torch.Tensor) -> None:
        with self._lock:
            for processor, rows in active:
                try:
                    processor.on_sampled(rows, tokens)
                except Exception as exc:
                    # The step's tokens stand; the processor's state of its rows does not.
                    logger.exception("%s failed in on_sampled", type(processor).__qualname__)
                    message = failure_message(processor, "on_sampled", exc)
                    self.failed.fail(rows.slots, message, self.processors)

    def failed_rows(self, slots: torch.Tensor | None) -> dict[int, str] | None:
        """The step's rows (``slots``: the batch's) whose slot failed, with why; None if none
        did (the common case costs one test)."""
        with self._lock:
            if not self.failed or slots is None:
                return None
            return self.failed.rows_of(slots.numpy()) or None


def needs_pre_temperature(active: _Active) -> bool:
    return any(not processor.after_temperature for processor, _ in active)


def needs_after_temperature(active: _Active) -> bool:
    return any(processor.after_temperature for processor, _ in active)


def apply_grammar_masks(logits: torch.Tensor, masks: GrammarMasks) -> None:
    """Set to -inf, in place, the logits of tokens a row's grammar does not allow."""
    device = logits.device
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (masks.bitmask.to(device).unsqueeze(-1) >> shifts) & 1
    allowed = bits.flatten(1)[:, :vocab].bool()
    rows = masks.rows.to(device)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than ``min_p`` times the row's most likely token (after
    temperature); a row with min_p 0 keeps everything."""
    probs = scaled.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.to(scaled.device).unsqueeze(1)
    return scaled.masked_fill(probs < threshold, float("-inf"))
