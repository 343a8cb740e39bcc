"""Every scenario by name: broken variants are caught within 200 PCT schedules for 20 seeds
in a row (4 for the one that runs a whole engine under Triton's interpreter, see below) and
replay from their file; correct variants pass a fixed set of schedules (1,000 for the cheap
ones; fewer for those that run the real executor or a whole engine, see below), 10,000 each
in ``tox -e sim-deep``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tandem_sim.explore import ReplayMismatch, explore, replay, save
from tandem_sim.scenarios import SCENARIOS

BROKEN = sorted(name for name, spec in SCENARIOS.items() if spec.broken)
CORRECT = sorted(name for name, spec in SCENARIOS.items() if not spec.broken)


# Seeds in a row each broken variant must be caught for. hybrid_first_request's runs the
# whole engine with its Triton kernels under the interpreter, about 5 s a run on a 2-core AMD
# EPYC (AVX2) guest, and is caught on each seed's first schedule: its 20 seeds, each caught
# and replayed, took 196 s of a 1,370-s suite run there, its longest test but one.
BROKEN_SEEDS = 20
SUITE_BROKEN_SEEDS = {"hybrid_first_request_unsynchronized": 4}


@pytest.mark.parametrize("name", BROKEN)
def test_broken_variant_is_caught_for_every_seed_and_replays(name: str, tmp_path: Path) -> None:
    firsts = []
    for seed in range(SUITE_BROKEN_SEEDS.get(name, BROKEN_SEEDS)):
        result = explore(SCENARIOS[name], "pct", schedules=200, seed=seed)
        assert result.failure is not None, f"{name}, seed {seed}: not caught in 200 schedules"
        assert result.failing_run is not None
        firsts.append(result.failing_run)
        path = tmp_path / f"{name}-{seed}.json"
        save(result, path)
        _, outcome = replay(path)
        assert outcome.describe() == result.failure.describe()
    assert max(firsts) <= 200


@pytest.mark.parametrize("name", BROKEN)
def test_broken_variant_is_caught_by_exhaustive_search(name: str) -> None:
    result = explore(SCENARIOS[name], "exhaustive", schedules=2000, seed=0)
    assert result.failure is not None


# The suite's counts are sized for CI on the slowest class of machine it runs on (2 cores,
# AMD Zen 1 with AVX2, where all of CI must stay under 15 minutes: 18 with the counts before
# these); the deep runs are `tox -e sim-deep`. Scenarios that run steps of the real executor
# per schedule take 20-150 ms each there; hybrid_first_request runs the whole engine over
# four steps on two lanes with its Triton kernels under the interpreter (about 2.6 s a
# schedule; its broken variant is caught on the first).
DEFAULT_SCHEDULES = 1000
SUITE_SCHEDULES = {
    "tp_forward": 160,
    "tp_forward_4": 100,
    "rank_dies_mid_collective": 160,
    "tp_lanes": 100,
    "llm_lanes_kv_pressure": 80,
    "hybrid_first_request": 30,
}
# The lifecycle scenarios run a whole engine per schedule (tens of TP=2 steps, 0.2-0.5 s on
# one Zen 1 core, the recommender's the slowest): 120 each in the suite, as two seeds of 60
# the suite's workers share (their broken variants are caught in 1); 10,000 each in
# `tox -e sim-deep`.
LIFECYCLE = sorted(name for name in CORRECT if "lifecycle" in name)
LIFECYCLE_SEEDS, LIFECYCLE_PER_SEED = 2, 60


@pytest.mark.parametrize("name", [name for name in CORRECT if name not in LIFECYCLE])
def test_correct_variant_passes_its_schedules(name: str) -> None:
    schedules = SUITE_SCHEDULES.get(name, DEFAULT_SCHEDULES)
    result = explore(SCENARIOS[name], "pct", schedules=schedules, seed=0)
    assert result.failure is None, result.failure.describe() if result.failure else ""
    assert result.runs == schedules


@pytest.mark.parametrize("seed", range(LIFECYCLE_SEEDS))
@pytest.mark.parametrize("name", LIFECYCLE)
def test_whole_engine_lifecycle_passes_its_schedules(name: str, seed: int) -> None:
    result = explore(SCENARIOS[name], "pct", schedules=LIFECYCLE_PER_SEED, seed=seed)
    assert result.failure is None, result.failure.describe() if result.failure else ""
    assert result.runs == LIFECYCLE_PER_SEED


def test_failures_say_what_went_wrong() -> None:
    race = explore(SCENARIOS["registry_race_unsynchronized"], "pct", 200, seed=0).failure
    assert race is not None
    assert "507028" in race.describe() or "Kernel stub is null" in race.describe()
    order = explore(SCENARIOS["two_groups_mismatched_order"], "pct", 200, seed=0).failure
    assert order is not None and order.deadlock is not None
    assert "group tp #0 all_reduce (rank 0), waiting for ranks [1]" in order.deadlock
    assert "group dp #0 all_reduce (rank 1), waiting for ranks [0]" in order.deadlock
    device = explore(SCENARIOS["raw_set_device"], "pct", 200, seed=0).failure
    assert device is not None and "stale device" in device.describe()


def test_a_replay_that_diverges_is_an_error(tmp_path: Path) -> None:
    result = explore(SCENARIOS["registry_race_unsynchronized"], "pct", 200, seed=3)
    path = tmp_path / "race.json"
    save(result, path)
    record = json.loads(path.read_text())
    record["decisions"][2][1] = "a label the run never reaches"
    path.write_text(json.dumps(record))
    with pytest.raises(ReplayMismatch, match="diverged"):
        replay(path)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tandem_sim", *args], capture_output=True, text=True, timeout=300
    )


def test_cli_exit_codes(tmp_path: Path) -> None:
    listed = _cli("list")
    assert listed.returncode == 0 and all(name in listed.stdout for name in SCENARIOS)
    out = tmp_path / "found.json"
    found = _cli("explore", "registry_race_unsynchronized", "--strategy", "pct",
                 "--schedules", "200", "--seed", "1", "--out", str(out))  # fmt: skip
    assert found.returncode == 1
    assert "FAILED after" in found.stdout and f"python -m tandem_sim replay {out}" in found.stdout
    again = _cli("replay", str(out))
    assert again.returncode == 1 and "replayed" in again.stdout
    passed = _cli("explore", "registry_race", "--schedules", "50")
    assert passed.returncode == 0 and "50 schedules passed" in passed.stdout
    assert _cli("explore", "no_such_scenario").returncode == 2
    assert _cli("explore", "registry_race", "--schedules", "0").returncode == 2
    assert _cli("replay", str(tmp_path / "missing.json")).returncode == 2
