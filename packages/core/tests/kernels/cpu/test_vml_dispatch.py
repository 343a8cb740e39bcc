"""oneMKL's vector math dispatch settled on one thread before any worker computes (the cause of
the float16 all-reduce test's flake: see ``vml_dispatch``)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from tandem.core.kernels.cpu.vml_dispatch import VML_DTYPES, VML_OPS, WARM_UP_VALUE


@pytest.mark.parametrize("dtype", VML_DTYPES)
@pytest.mark.parametrize("name", VML_OPS)
def test_each_op_is_a_torch_function_defined_at_the_warm_up_value(
    name: str, dtype: torch.dtype
) -> None:
    out = getattr(torch, name)(torch.full((1,), WARM_UP_VALUE, dtype=dtype))
    assert out.dtype is dtype
    assert math.isfinite(out.item())


def test_a_worker_resolves_the_dispatch_in_init_device() -> None:
    """In a fresh process (this one's dispatch may be settled by any earlier test), on its main
    thread so that a failure exits non-zero: ``init_device`` leaves the dispatch resolved. The
    factory is never called (no model is loaded)."""
    script = """
from tandem.collectives import SingleRankGroup
from tandem.core.config import CacheConfig, EngineConfig, ModelLoadConfig
from tandem.core.kernels.cpu.vml_dispatch import resolve_vml_dispatch
from tandem.core.worker.worker import Worker
from tandem.device import Device

def no_model(context):
    raise AssertionError("init_device loads no model")

config = EngineConfig(model=ModelLoadConfig(model="unused"), cache=CacheConfig(num_blocks=8))
worker = Worker(Device("cpu", 0), SingleRankGroup(), config, no_model)
assert not resolve_vml_dispatch.made
worker.init_device()
print(resolve_vml_dispatch.made)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "True"
