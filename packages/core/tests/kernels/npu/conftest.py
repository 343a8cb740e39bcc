"""The torch_npu kernels run here against the simulator's stand-in of torch_npu's ops
(``tandem_sim.torch_npu_standin``, each op's rules transcribed from torch_npu's documentation),
installed as ``torch_npu`` for these tests: the kernels' calls must satisfy those rules, and
their results must match the torch references. Skipped where a real torch_npu is installed
(an NPU box runs ``hw/tests`` instead)."""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest

if "torch_npu" not in sys.modules and importlib.util.find_spec("torch_npu") is not None:
    pytest.skip("a real torch_npu is installed: hw/tests runs these ops", allow_module_level=True)
sys.modules.setdefault("torch_npu", importlib.import_module("tandem_sim.torch_npu_standin"))
