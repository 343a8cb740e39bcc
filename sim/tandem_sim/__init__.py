"""Deterministic simulation: Tandem's real code on real threads, one running at a time, with
the interleaving chosen by a strategy and recorded so a failing one replays exactly."""

from tandem_sim.scheduler import DeterministicScheduler, Outcome, SimThread
from tandem_sim.strategies import PCT, RandomWalk, Replay, Strategy

__all__ = [
    "PCT",
    "DeterministicScheduler",
    "Outcome",
    "RandomWalk",
    "Replay",
    "SimThread",
    "Strategy",
]
