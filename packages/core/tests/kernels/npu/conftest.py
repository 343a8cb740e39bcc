"""The torch_npu kernels run here against the simulator's stand-in of torch_npu's ops
(``tandem_sim.torch_npu_standin``, each op's rules transcribed from torch_npu's documentation):
the kernels' calls must satisfy those rules, and their results must match the torch references.

The stand-in takes torch_npu's place only while these modules import (the kernel modules keep
it) and, through the ``standin_torch_npu`` fixture, while a test resolves kernels: a process
that runs other suites after these must not see a torch_npu (``hw/tests`` would take it for a
real one). Skipped where a real torch_npu is installed (an NPU box runs ``hw/tests``)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest

if "torch_npu" not in sys.modules and importlib.util.find_spec("torch_npu") is not None:
    pytest.skip("a real torch_npu is installed: hw/tests runs these ops", allow_module_level=True)

STANDIN: ModuleType = importlib.import_module("tandem_sim.torch_npu_standin")
MODULES = ("activation", "attention", "fused_moe", "int4_linear", "int8_linear", "norms", "rotary")


def _import_kernels() -> None:
    sys.modules["torch_npu"] = STANDIN
    try:
        for name in MODULES:
            importlib.import_module(f"tandem.core.kernels.npu.{name}")
    finally:
        del sys.modules["torch_npu"]


_import_kernels()


@pytest.fixture
def standin_torch_npu(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    monkeypatch.setitem(sys.modules, "torch_npu", STANDIN)
    yield STANDIN
