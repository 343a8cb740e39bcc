"""How the scheduler picks the next task at each decision point."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol


class Strategy(Protocol):
    name: str

    def on_task_created(self, task: str) -> None: ...

    def choose(self, runnable: Sequence[str], step: int) -> str: ...


class RandomWalk:
    """Uniformly random among the runnable tasks, from a seed."""

    name = "random"

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._rng = random.Random(seed)

    def on_task_created(self, task: str) -> None:
        pass

    def choose(self, runnable: Sequence[str], step: int) -> str:
        return runnable[self._rng.randrange(len(runnable))]


class PCT:
    """Probabilistic concurrency testing (Burckhardt et al.): random distinct priorities,
    highest runnable priority runs, and at ``depth - 1`` random steps the running task drops
    to a priority below all others. Finds any bug of depth d with probability >= 1/(n k^(d-1))."""

    name = "pct"

    def __init__(self, seed: int, depth: int = 3, steps: int = 100) -> None:
        self.seed = seed
        self.depth = depth
        self._rng = random.Random(seed)
        self._priority: dict[str, float] = {}
        self._change_points = {self._rng.randrange(1, max(steps, 2)) for _ in range(depth - 1)}
        self._low = 0.0

    def on_task_created(self, task: str) -> None:
        # Distinct priorities above every value a change point can assign.
        self._priority[task] = 1.0 + self._rng.random()

    def choose(self, runnable: Sequence[str], step: int) -> str:
        chosen = max(runnable, key=lambda t: self._priority.get(t, 1.0))
        if step in self._change_points:
            self._low -= 1.0
            self._priority[chosen] = self._low
            chosen = max(runnable, key=lambda t: self._priority.get(t, 1.0))
        return chosen


class ReplayDiverged(RuntimeError):
    """A replayed run offered choices that the recorded schedule does not match."""


class Replay:
    """Follow a recorded list of decisions exactly; any divergence is an error."""

    name = "replay"

    def __init__(self, decisions: Sequence[str]) -> None:
        self._decisions = list(decisions)

    def on_task_created(self, task: str) -> None:
        pass

    def choose(self, runnable: Sequence[str], step: int) -> str:
        if step >= len(self._decisions):
            raise ReplayDiverged(f"step {step}: the recorded schedule has ended")
        wanted = self._decisions[step]
        if wanted not in runnable:
            raise ReplayDiverged(
                f"step {step}: recorded {wanted!r}, runnable now {sorted(runnable)}"
            )
        return wanted
