"""The seed's bugs as schedules: the broken variants are found, the shipped code passes."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from tandem_sim import PCT, DeterministicScheduler, Outcome, Replay
from tandem_sim.broken import UnsynchronizedRegistry
from tandem_sim.fake_runtime import FakeNpuRuntime
from tandem_sim.strategies import Strategy

from tandem.collectives import CollectiveTimeout, create_inprocess_groups
from tandem.device import Device, KernelKey, KernelRegistry

KEY = KernelKey("layer_norm_fwd_kernel", Device("npu", 0), "bfloat16")


def _registry_race(broken: bool) -> Callable[[DeterministicScheduler], None]:
    def scenario(s: DeterministicScheduler) -> None:
        runtime = FakeNpuRuntime(s)
        registry = UnsynchronizedRegistry(s) if broken else KernelRegistry[str](s)

        def first_forward() -> None:
            stub = registry.get(KEY, lambda: runtime.register_function(KEY.kernel, 0))
            runtime.launch(stub)

        threads = [s.start_thread(first_forward, f"worker{i}") for i in range(2)]
        for t in threads:
            t.join()
        assert runtime.registrations == 1

    return scenario


def _two_groups(mismatched: bool) -> Callable[[DeterministicScheduler], None]:
    def scenario(s: DeterministicScheduler) -> None:
        tp = create_inprocess_groups(2, timeout_s=60, sync=s)
        dp = create_inprocess_groups(2, timeout_s=60, sync=s)

        def rank(r: int) -> None:
            order = [tp[r], dp[r]] if (r == 0 or not mismatched) else [dp[r], tp[r]]
            for group in order:
                group.all_reduce(torch.ones(2))

        threads = [s.start_thread(partial(rank, r), f"rank{r}") for r in range(2)]
        for t in threads:
            t.join()

    return scenario


def _explore(
    scenario: Callable[[DeterministicScheduler], None], seed: int, schedules: int
) -> tuple[int, Outcome] | None:
    for i in range(schedules):
        strategy: Strategy = PCT(seed=seed * 100_003 + i, depth=3, steps=40)
        s = DeterministicScheduler(strategy, watchdog_s=5)
        outcome = s.run(partial(scenario, s))
        if not outcome.ok:
            return i + 1, outcome
    return None


def test_unsynchronized_registry_race_is_found_for_every_seed() -> None:
    for seed in range(20):
        found = _explore(_registry_race(broken=True), seed, schedules=200)
        assert found is not None, f"seed {seed}: race not found in 200 schedules"
        _, outcome = found
        text = outcome.describe()
        assert "507028" in text or "Kernel stub is null" in text or "registrations" in text
        s = DeterministicScheduler(Replay(outcome.decisions), watchdog_s=5)
        assert s.run(partial(_registry_race(broken=True), s)).describe() == text


def test_real_registry_passes_every_schedule() -> None:
    assert _explore(_registry_race(broken=False), seed=0, schedules=500) is None


def test_mismatched_group_order_is_found_and_names_the_missing_ranks() -> None:
    found = _explore(_two_groups(mismatched=True), seed=0, schedules=50)
    assert found is not None
    _, outcome = found
    errors = list(outcome.errors.values())
    assert errors and all(isinstance(e, CollectiveTimeout) for e in errors)
    assert any("waited 60 s for ranks [1]" in str(e) for e in errors)


def test_same_order_groups_pass_every_schedule() -> None:
    assert _explore(_two_groups(mismatched=False), seed=0, schedules=300) is None
