"""Run a scenario under many schedules; save a failing one to a JSON file that replays it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from tandem_sim.scenarios import SCENARIOS, ScenarioSpec
from tandem_sim.scheduler import DeterministicScheduler, Outcome
from tandem_sim.strategies import PCT, Exhaustive, RandomWalk, Replay, Strategy

STRATEGIES = ("random", "pct", "exhaustive")


@dataclass
class Exploration:
    scenario: str
    strategy: str
    seed: int
    runs: int
    failure: Outcome | None = None
    failing_run: int | None = None


def run_once(spec: ScenarioSpec, strategy: Strategy, watchdog_s: float = 30.0) -> Outcome:
    scheduler = DeterministicScheduler(strategy, watchdog_s=watchdog_s)
    return scheduler.run(partial(spec.run, scheduler))


def explore(spec: ScenarioSpec, strategy: str, schedules: int, seed: int) -> Exploration:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    result = Exploration(spec.name, strategy, seed, runs=0)
    steps = len(run_once(spec, RandomWalk(seed)).decisions) if strategy == "pct" else 0
    exhaustive = Exhaustive(bound=2) if strategy == "exhaustive" else None
    for i in range(schedules):
        current: Strategy
        if exhaustive is not None:
            if i > 0 and not exhaustive.next_run():
                break
            current = exhaustive
        elif strategy == "pct":
            current = PCT(seed=seed * 1_000_003 + i, depth=3, steps=max(steps, 2))
        else:
            current = RandomWalk(seed * 1_000_003 + i)
        outcome = run_once(spec, current)
        result.runs = i + 1
        if not outcome.ok:
            result.failure, result.failing_run = outcome, i + 1
            break
    return result


def save(result: Exploration, path: Path) -> None:
    assert result.failure is not None
    outcome = result.failure
    path.write_text(
        json.dumps(
            {
                "scenario": result.scenario,
                "strategy": result.strategy,
                "seed": result.seed,
                "run": result.failing_run,
                "tasks": sorted(set(outcome.decisions)),
                "decisions": [[t, label] for t, label in zip(outcome.decisions, outcome.labels,
                                                             strict=True)],
                "failure": outcome.describe(),
            },
            indent=1,
        )
        + "\n"
    )  # fmt: skip


class ReplayMismatch(RuntimeError):
    """The replayed run took a different path than the file records."""


def replay(path: Path) -> tuple[dict[str, Any], Outcome]:
    record = json.loads(path.read_text())
    spec = SCENARIOS.get(record["scenario"])
    if spec is None:
        raise ValueError(f"{path} names unknown scenario {record['scenario']!r}")
    decisions = [d[0] for d in record["decisions"]]
    outcome = run_once(spec, Replay(decisions))
    recorded = [tuple(d) for d in record["decisions"]]
    actual = list(zip(outcome.decisions, outcome.labels, strict=True))
    if actual != recorded:
        step = next(
            (i for i, (a, b) in enumerate(zip(actual, recorded, strict=False)) if a != b),
            min(len(actual), len(recorded)),
        )
        raise ReplayMismatch(f"replay diverged from {path} at step {step}")
    return record, outcome
