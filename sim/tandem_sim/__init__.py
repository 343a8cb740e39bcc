"""Deterministic simulation: Tandem's real code on real threads, one running at a time, with
the interleaving chosen by a strategy and recorded so a failing one replays exactly."""

import os

# The fake NPU keeps its tensors in host memory, where Triton's kernels run only under its
# interpreter; Triton reads the variable when each kernel is decorated, so it is set before
# anything here can import Triton (an explicit 0 is left alone, and Triton then refuses).
os.environ.setdefault("TRITON_INTERPRET", "1")


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
