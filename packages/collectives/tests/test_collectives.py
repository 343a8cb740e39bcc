"""Collectives equal their reference for every op, with ranks really concurrent: in-process
threads, torch.distributed processes (2 and 4) and two-level groups (2 nodes x 2 threads)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from collective_checks import contribution, run_checks  # noqa: E402

from tandem.collectives import (  # noqa: E402
    CollectiveAborted,
    CollectiveMismatch,
    CollectiveTimeout,
    InProcessGroup,
    create_inprocess_groups,
)
from tandem.server.bench.ports import free_port  # noqa: E402


def _in_threads(
    groups: list[InProcessGroup], body: Callable[[InProcessGroup], None]
) -> list[BaseException]:
    errors: list[BaseException] = []
    start = threading.Barrier(len(groups))

    def run(group: InProcessGroup) -> None:
        try:
            start.wait()
            body(group)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(g,)) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return errors


@pytest.mark.parametrize("size", [1, 2, 4])
def test_inprocess_matches_reference(size: int) -> None:
    groups = create_inprocess_groups(size, timeout_s=30)
    assert _in_threads(groups, run_checks) == []
    assert all(g.sequence == groups[0].sequence > 0 for g in groups)


def test_inprocess_ranks_run_concurrently() -> None:
    # Matmuls release the GIL: two ranks doing real work overlap between collectives.
    groups = create_inprocess_groups(2, timeout_s=30)
    spans: dict[int, tuple[float, float]] = {}

    def body(group: InProcessGroup) -> None:
        a = torch.randn(600, 600)
        group.barrier()
        begin = time.perf_counter()
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        spans[group.rank] = (begin, time.perf_counter())
        group.all_reduce(a)

    assert _in_threads(groups, body) == []
    (b0, e0), (b1, e1) = spans[0], spans[1]
    assert max(b0, b1) < min(e0, e1), "the two ranks' work did not overlap"


def test_sum_is_in_rank_order_whatever_the_arrival_order() -> None:
    results: dict[int, torch.Tensor] = {}
    for delay_rank in (0, 1, 2):
        groups = create_inprocess_groups(3, timeout_s=30)

        def body(group: InProcessGroup, delay_rank: int = delay_rank) -> None:
            if group.rank == delay_rank:
                time.sleep(0.05)
            x = contribution(group.rank, (1000,)) * 1e3
            group.all_reduce(x)
            results.setdefault(delay_rank, x)

        assert _in_threads(groups, body) == []
    assert torch.equal(results[0], results[1]) and torch.equal(results[1], results[2])


def test_mismatched_collectives_fail_at_once() -> None:
    groups = create_inprocess_groups(2, timeout_s=30)

    def body(group: InProcessGroup) -> None:
        if group.rank == 0:
            group.all_reduce(torch.zeros(3))
        else:
            group.all_gather(torch.zeros(3))

    errors = _in_threads(groups, body)
    assert len(errors) == 2 and all(isinstance(e, CollectiveMismatch) for e in errors)
    assert "all_reduce" in str(errors[0]) and "all_gather" in str(errors[0])


def test_missing_rank_times_out_naming_it() -> None:
    groups = create_inprocess_groups(3, timeout_s=0.5)

    def body(group: InProcessGroup) -> None:
        if group.rank != 2:
            group.barrier()

    errors = _in_threads(groups, body)
    assert len(errors) == 2 and all(isinstance(e, CollectiveTimeout) for e in errors)
    assert "ranks [2]" in str(errors[0])


def test_abort_wakes_waiting_ranks() -> None:
    groups = create_inprocess_groups(2, timeout_s=30)

    def body(group: InProcessGroup) -> None:
        if group.rank == 0:
            group.barrier()
        else:
            time.sleep(0.1)
            group.communicator.abort("rank 1 failed")

    errors = _in_threads(groups, body)
    assert len(errors) == 1 and isinstance(errors[0], CollectiveAborted)


def _run_world(mode: str, world: int, *extra: str) -> None:
    # Below the ephemeral range: no client connection can hold it when the master binds.
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "dist_worker.py"),
                mode,
                str(r),
                str(world),
                str(port),
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outputs = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        outputs.append((p.returncode, out))
    for code, out in outputs:
        assert code == 0 and "OK" in out, out


@pytest.mark.parametrize("world", [2, 4])
def test_torch_distributed_group(world: int) -> None:
    _run_world("flat", world)


def test_two_level_group_two_nodes_of_two() -> None:
    _run_world("two-level", 2, "2")


def test_rendezvous_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.collectives import Rendezvous

    rdzv = Rendezvous.parse("10.0.0.5:29500", world_size=4, rank=3)
    assert rdzv.init_method == "tcp://10.0.0.5:29500"
    assert Rendezvous.parse("::1:29500", 2, 0).init_method == "tcp://[::1]:29500"
    for bad in ("nohost", "host:", ":29500", "host:port"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            Rendezvous.parse(bad, 2, 0)
    with pytest.raises(ValueError, match="outside a world"):
        Rendezvous.parse("h:1", 2, 2)
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="torchrun"):
        Rendezvous.parse("env://", 2, 0)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    env = Rendezvous.parse("env://", 2, 1)
    assert env.from_env and env.init_method == "env://"
    with pytest.raises(ValueError, match="torchrun says rank 1 of 2"):
        Rendezvous.parse("env://", 2, 0)
