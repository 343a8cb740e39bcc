"""The engine's clocks: the stall the watchdog acts on, the step /health calls too long."""

from __future__ import annotations

import pytest

from tandem.core.config import ParallelConfig, SchedulerConfig
from tandem.core.errors import EngineUnhealthyError
from tandem.core.kv.block_manager import BlockManager
from tandem.core.llm.in_flight import InFlightSteps
from tandem.core.llm.scheduler import Scheduler
from tandem.core.llm.stall_watch import StallWatch
from tandem.device.sync import ThreadingSync


class _Clock(ThreadingSync):
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def _watch(clock: _Clock, limits: ParallelConfig | None = None) -> StallWatch:
    scheduler = Scheduler(
        SchedulerConfig(), BlockManager(num_blocks=8, block_size=4, enable_prefix_cache=False)
    )
    return StallWatch(limits or ParallelConfig(), scheduler, InFlightSteps(scheduler), clock)


def test_the_stall_counts_from_the_last_progress() -> None:
    clock = _Clock()
    watch = _watch(clock)
    clock.now += 7.5
    assert watch.stalled_for() == 7.5
    watch.progressed()
    clock.now += 2.0
    assert watch.stalled_for() == 2.0


def test_a_step_past_the_health_deadline_is_unhealthy_and_only_then() -> None:
    clock = _Clock()
    watch = _watch(clock, ParallelConfig(health_timeout_s=10.0, timeout_s=30.0))
    clock.now += 100.0
    watch.check_busy()  # no step runs: idle is healthy however long
    watch.busy_since = clock.now
    clock.now += 10.0
    watch.check_busy()
    clock.now += 1.0
    with pytest.raises(EngineUnhealthyError) as err:
        watch.check_busy()
    assert str(err.value) == (
        "a step has been running for 11 s, over the 10 s health deadline (it fails at 30 s)"
    )


def test_giving_up_logs_the_scheduler_state_once_and_says_it_is_a_bug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = _Clock()
    watch = _watch(clock)
    clock.now += 61.0
    message = watch.give_up()
    state = "running 0 (tokens to compute: []), waiting 0, in flight 0, free KV blocks 8 of 8"
    assert message == (
        f"the engine could not schedule the request and gave up on it ({state}); this is a "
        "bug, please report it"
    )
    [record] = [r for r in caplog.records if r.levelname == "ERROR"]
    assert record.getMessage() == f"the engine made no progress for 61.0 s; {state}"
