"""Collectives are picked by device kind at start-up and every choice that cannot work fails
before a worker starts, with a message that says what to do."""

from __future__ import annotations

from pathlib import Path

import pytest
from tandem_hw.comm_backend import HcclBackend, NcclBackend
from tandem_hw.hccl import DEFAULT_CANN_ROOTS

from tandem.core.config import ParallelConfig
from tandem.core.errors import ConfigError
from tandem.core.parallel.collective_choice import resolve_collectives


def test_auto_picks_the_device_kinds_library(standin_path: Path) -> None:
    auto = ParallelConfig()
    cpu = resolve_collectives(auto, "cpu", uses_local=True, uses_process=True)
    assert (cpu.local, cpu.process, cpu.dist_backend) == ("inprocess", "torch", "gloo")
    # On NPU/CUDA the world group only carries the root info, so it stays on CPU (gloo).
    for kind, name in (("npu", "hccl"), ("cuda", "nccl")):
        choice = resolve_collectives(auto, kind, uses_local=False, uses_process=False)
        assert (choice.local, choice.process, choice.dist_backend) == (name, name, "gloo")
    torch_path = ParallelConfig(process_collectives="torch")
    npu = resolve_collectives(torch_path, "npu", uses_local=False, uses_process=False)
    assert npu.dist_backend == "hccl"


def test_hardware_collectives_on_cpu_need_the_standin(
    standin_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HCCL_SO_PATH", str(standin_path))
    HcclBackend().check("cpu")
    HcclBackend().check("npu")
    with pytest.raises(ValueError, match="nccl collectives serve cuda devices, not npu"):
        monkeypatch.setenv("NCCL_SO_PATH", str(standin_path))
        NcclBackend().check("npu")


def test_a_missing_library_fails_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    if any((root / "lib64" / "libhccl.so").exists() for root in DEFAULT_CANN_ROOTS):
        pytest.skip("this machine has a CANN install at a default place")
    for name in ("HCCL_SO_PATH", "ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=r"hccl collectives: libhccl\.so not found"):
        HcclBackend().check("npu")


def test_refused_combinations(standin_path: Path) -> None:
    with pytest.raises(ConfigError, match="exchanges its communicator id over a CPU group"):
        resolve_collectives(
            ParallelConfig(dist_backend="hccl"), "npu", uses_local=False, uses_process=True
        )
    with pytest.raises(ConfigError, match="cannot span processes"):
        resolve_collectives(
            ParallelConfig(process_collectives="inprocess"),
            "cpu",
            uses_local=False,
            uses_process=True,
        )
    with pytest.raises(ConfigError, match="cannot serve npu devices"):
        resolve_collectives(
            ParallelConfig(local_collectives="inprocess"),
            "npu",
            uses_local=True,
            uses_process=False,
        )
    with pytest.raises(ConfigError, match="no collective backend named 'mpi'"):
        resolve_collectives(
            ParallelConfig(local_collectives="mpi"), "cpu", uses_local=True, uses_process=False
        )
