"""/health's view of the engine: a step that runs past the health deadline makes the engine
unhealthy (not dead) while it lasts; one past the step timeout fails, naming the late rank."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tandem.core import EngineDeadError, LLMEngine, SamplingParams
from tandem.core.config import (
    CacheConfig,
    EngineConfig,
    ModelLoadConfig,
    ParallelConfig,
    PipelineConfig,
)
from tandem.core.errors import EngineUnhealthyError
from tandem.core.faults import Fault, FaultConfig

PARAMS = SamplingParams.greedy(max_tokens=4, ignore_eos=True)


def _engine(model: Path, delay_s: float, timeout_s: float, lanes: int = 1) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelLoadConfig(model=str(model)),
            cache=CacheConfig(num_blocks=64),
            parallel=ParallelConfig(timeout_s=timeout_s, health_timeout_s=0.3),
            pipeline=PipelineConfig(max_concurrency=lanes),
            faults=FaultConfig((Fault("forward_delay", rank=0, step=1, seconds=delay_s),)),
        )
    )


@pytest.mark.parametrize("lanes", [1, 2])
def test_a_step_past_the_health_deadline_is_unhealthy_while_it_runs(
    demo_dir: Path, lanes: int
) -> None:
    engine = _engine(demo_dir, delay_s=1.5, timeout_s=30, lanes=lanes)
    try:
        engine.add_request("a", "hello", PARAMS)
        engine.step()
        stepping = threading.Thread(target=lambda: [engine.step() for _ in range(3)])
        stepping.start()
        deadline = time.monotonic() + 10
        while True:
            try:
                engine.check_health()
            except EngineUnhealthyError as exc:
                assert not isinstance(exc, EngineDeadError)
                assert "health deadline" in str(exc)
                break
            assert time.monotonic() < deadline, "health never reported the slow step"
            time.sleep(0.05)
        stepping.join(30)
        engine.check_health()  # healthy again once the step is done
        assert engine.dead is None
    finally:
        engine.shutdown()


def test_a_step_past_the_step_timeout_fails_naming_the_late_rank(demo_dir: Path) -> None:
    engine = _engine(demo_dir, delay_s=30, timeout_s=0.5)
    try:
        engine.add_request("a", "hello", PARAMS)
        engine.step()
        started = time.monotonic()
        outs = engine.step()
        assert time.monotonic() - started < 10
        assert [o.finish_reason for o in outs] == ["error"]
        assert "rank 0 (cpu:0) did not finish the step" in (outs[0].error or "")
        with pytest.raises(EngineDeadError, match="did not finish"):
            engine.check_health()
    finally:
        engine.shutdown()
