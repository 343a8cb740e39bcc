"""How long past the step timeout the engine and the executors wait for a step.

A module of its own because both sides read it: the executors that run steps and the
engines that set deadlines for them; the executor factory imports the executors, so the
figure cannot live beside it."""

from __future__ import annotations

# How much longer than the step timeout an executor waits for a step: the collectives that
# ranks are blocked in time out at the step timeout, and reporting theirs first tells the
# rank that never arrived from the ranks it held up.
STEP_TIMEOUT_GRACE_S = 2.0
