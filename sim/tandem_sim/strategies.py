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


class Exhaustive:
    """Every schedule with at most ``bound`` preemptions (switching away from a task that
    could have continued), depth first. One instance drives many runs: call ``next_run()``
    between them until it returns False."""

    name = "exhaustive"

    def __init__(self, bound: int = 2) -> None:
        self.bound = bound
        # Per decision: the options offered (in order), the index taken, preemptions so far.
        self._path: list[tuple[list[str], int, int]] = []
        self._last: str | None = None

    def on_task_created(self, task: str) -> None:
        pass

    def choose(self, runnable: Sequence[str], step: int) -> str:
        if step < len(self._path):
            options, index, _ = self._path[step]
            chosen = options[index]
            if chosen not in runnable:
                raise ReplayDiverged(f"step {step}: {chosen!r} is not runnable on re-run")
        else:
            used = self._path[-1][2] if self._path else 0
            last = self._last
            if last is not None and last in runnable:
                others = sorted(t for t in runnable if t != last)
                options = [last, *(others if used < self.bound else [])]
            else:
                options = sorted(runnable)
            self._path.append((options, 0, used))
            chosen = options[0]
        self._last = chosen
        return chosen

    def next_run(self) -> bool:
        """Move to the next unexplored schedule; False when all are done."""
        self._last = None
        while self._path:
            options, index, _ = self._path.pop()
            if index + 1 < len(options):
                before = self._path[-1][2] if self._path else 0
                # Taking a later option than the continuing task is one more preemption.
                preempts = before + 1 if options[0] == self._continuing(len(self._path)) else before
                self._path.append((options, index + 1, preempts))
                return True
        return False

    def _continuing(self, step: int) -> str | None:
        """The task that ran at the step before ``step`` (None at the start)."""
        if step == 0:
            return None
        options, index, _ = self._path[step - 1]
        return options[index]
