"""Scheduling decisions, kept apart from the scheduler's state so they can be swapped."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

from tandem.core.llm.sequence import TokenSequence


class SchedulingPolicy(Protocol):
    def preemption_victim(self, running: Seq[TokenSequence]) -> TokenSequence:
        """Which running sequence gives its blocks back when decode runs out of blocks."""
        ...

    def resume_position(self, waiting: Seq[TokenSequence], preempted: TokenSequence) -> int:
        """Where a preempted sequence re-enters the waiting queue."""
        ...


class FcfsPolicy:
    """First come, first served; the newest request is preempted first and resumes first."""

    def preemption_victim(self, running: Seq[TokenSequence]) -> TokenSequence:
        return max(running, key=lambda s: (s.metrics.arrival_time, s.request_id))

    def resume_position(self, waiting: Seq[TokenSequence], preempted: TokenSequence) -> int:
        return 0
