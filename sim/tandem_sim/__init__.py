"""Deterministic simulation: Tandem's real code on real threads, one running at a time, with
the interleaving chosen by a strategy and recorded so a failing one replays exactly."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from tandem.device.lazy_exports import lazy_exports

# The fake NPU keeps its tensors in host memory, where Triton's kernels run only under its
# interpreter; Triton reads the variable when each kernel is decorated, so it is set before
# anything here can import Triton (an explicit 0 is left alone, and Triton then refuses).
os.environ.setdefault("TRITON_INTERPRET", "1")

if TYPE_CHECKING:
    from tandem_sim.scheduler import DeterministicScheduler, Outcome, SimThread
    from tandem_sim.strategies import PCT, RandomWalk, Replay, Strategy

# Each public name and the module that defines it, imported on first use so that importing
# one submodule does not load the others (see tandem.device.lazy_exports).
_EXPORTS = {
    "PCT": "tandem_sim.strategies",
    "DeterministicScheduler": "tandem_sim.scheduler",
    "Outcome": "tandem_sim.scheduler",
    "RandomWalk": "tandem_sim.strategies",
    "Replay": "tandem_sim.strategies",
    "SimThread": "tandem_sim.scheduler",
    "Strategy": "tandem_sim.strategies",
}

__all__ = [
    "PCT",
    "DeterministicScheduler",
    "Outcome",
    "RandomWalk",
    "Replay",
    "SimThread",
    "Strategy",
]

if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
