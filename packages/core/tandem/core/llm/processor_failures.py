"""A logits processor that raises fails the requests whose rows it serves, not the step.

Processors are an extension point: a plugin's bug must cost the requests that use it, while
the step's other rows are sampled as if it had never run and the engine keeps serving. The
sampling worker remembers each failed slot (``FailedSlots``) until the engine frees it, turns
it off in every processor (its state there is nothing to trust), and reports the slot's rows
as data in the step's ``SamplerOutput`` (which crosses processes); the engine ends those
requests with the message and appends nothing from their rows.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from tandem.core.failure_text import describe

if TYPE_CHECKING:
    from tandem.core.llm.logits_processor import LogitsProcessor, StepRows

logger = logging.getLogger(__name__)


def failure_message(processor: LogitsProcessor, method: str, error: BaseException) -> str:
    """What a request is told when ``processor``'s ``method`` raised ``error`` for it."""
    cls = type(processor)
    return f"the logits processor {cls.__qualname__} ({cls.__module__}) failed in {method}: " + (
        describe(error)
    )


class ProcessorFailed(Exception):
    """Raised out of a batched ``apply`` (never out of the sampler): ``processor`` raised, or
    returned logits of another shape, for a step in which it serves ``rows``."""

    def __init__(self, processor: LogitsProcessor, rows: StepRows, message: str) -> None:
        super().__init__(message)
        self.processor = processor
        self.rows = rows
        self.message = message


class FailedSlots:
    """Slots whose processor failed, each with the message its request ends with; a slot is
    forgotten when the engine removes it or gives it to a new row. Called under the
    processors' lock."""

    def __init__(self) -> None:
        self._messages: dict[int, str] = {}

    def __bool__(self) -> bool:
        return bool(self._messages)

    def __contains__(self, slot: int) -> bool:
        return slot in self._messages

    def fail(
        self, slots: Iterable[int], message: str, processors: Iterable[LogitsProcessor]
    ) -> None:
        """Fail ``slots`` with ``message`` (a slot keeps its first message) and turn them off
        in every processor, so none is called for them again."""
        chosen = [int(slot) for slot in slots]
        for slot in chosen:
            self._messages.setdefault(slot, message)
        for processor in processors:
            processor.active[chosen] = False
        logger.error("slots %s fail their requests: %s", chosen, message)

    def forget(self, slots: Iterable[int]) -> None:
        for slot in slots:
            self._messages.pop(slot, None)

    def rows_of(self, slots: np.ndarray) -> dict[int, str]:
        """The rows of a step (``slots``: each row's slot, -1 for none) whose slot failed."""
        failed = np.flatnonzero(np.isin(slots, np.fromiter(self._messages, dtype=np.int64)))
        return {int(row): self._messages[int(slots[row])] for row in failed}
