"""oneMKL's vector math dispatch settled on one thread before any worker computes (the cause of
the float16 all-reduce test's flake: see ``vml_dispatch``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from tandem.core.kernels.cpu.vml_dispatch import VML_DTYPES, VML_OPS, resolve_vml_dispatch
from tandem.core.kernels.process_once import ProcessOnce


def test_every_vml_op_is_called_in_both_dtypes_once_per_process() -> None:
    calls = resolve_vml_dispatch()
    assert calls == len(VML_OPS) * len(VML_DTYPES) == 32
    assert resolve_vml_dispatch.made
    # Made once: the second call returns the first's count without calling anything.
    assert resolve_vml_dispatch() is calls
    # Every name is a torch op that accepts a float in its domain (a typo would have raised).
    assert all(callable(getattr(torch, name)) for name in VML_OPS)


def test_process_once_reports_whether_its_value_is_made() -> None:
    once = ProcessOnce(lambda: 7)
    assert not once.made
    assert once() == 7
    assert once.made


def test_a_worker_resolves_the_dispatch_before_it_binds_its_device(demo_dir: Path) -> None:
    """In a fresh process (this one's dispatch may be settled by any earlier test): a worker's
    ``init_device`` leaves the dispatch resolved, before its model load computes anything."""
    script = f"""
import threading
from pathlib import Path
from tandem.collectives import SingleRankGroup
from tandem.core.config import CacheConfig, EngineConfig, ModelLoadConfig
from tandem.core.kernels.cpu.vml_dispatch import resolve_vml_dispatch
from tandem.core.llm.model_runner import LLMRunnerFactory
from tandem.core.models.config_json import load_model_config
from tandem.core.worker.worker import Worker
from tandem.device import Device

folder = Path({str(demo_dir)!r})
config = EngineConfig(model=ModelLoadConfig(model=str(folder)), cache=CacheConfig(num_blocks=8))
factory = LLMRunnerFactory(load_model_config(folder))
worker = Worker(Device("cpu", 0), SingleRankGroup(), config, factory)
assert not resolve_vml_dispatch.made
thread = threading.Thread(target=worker.init_device)
thread.start()
thread.join(60)
print(resolve_vml_dispatch.made)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "True"
