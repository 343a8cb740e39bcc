"""No host sync on the NPU step: a worker bound to the simulator's NPU runtime (the torch_npu
stand-in and the Triton kernels, as an NPU resolves them) runs the model's forward of a mixed
step (decodes and prefill chunks after a cached prefix) under a dispatch mode that fails on
every op that reads a device value back to the host on a real device: ``item`` / ``int()`` /
``bool()`` (``_local_scalar_dense``), ``nonzero``, ``masked_select``, ``unique``,
``bincount``, ``repeat_interleave`` without an output size, ``equal``. Dense, hybrid (Gated
DeltaNet) and MoE demo models, in bfloat16 so the torch_npu attention ops run too.

What it cannot see: a copy to the host through ``.cpu()`` / ``.tolist()`` of a device tensor
(the stand-in's tensors are host memory already); the ops above are how such reads begin in
this code base, and the metadata's own copies are counted in
``tests/llm/test_attention_metadata_on_device.py``."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tandem_sim.fake_runtime import FakeNpuRuntime
from torch.utils._python_dispatch import TorchDispatchMode

from tandem.collectives import SingleRankGroup
from tandem.core.config import CacheConfig, EngineConfig, ModelLoadConfig
from tandem.core.demo.demo_model import tiny_spec, write_demo_model
from tandem.core.demo.family_demo_model import (
    Qwen3_5DemoSpec,
    Qwen3MoeDemoSpec,
    write_qwen3_5_demo_model,
    write_qwen3_moe_demo_model,
)
from tandem.core.kv.cache_sizing import CacheSize
from tandem.core.llm.model_runner import LLMRunnerFactory, ModelRunner
from tandem.core.models.config_json import load_model_config
from tandem.core.worker.worker import Worker
from tandem.device import Device, KernelRegistry
from tandem.device.sync import REAL_SYNC

from ..cpu.attention_steps import make_step

pytest.importorskip("triton")

SYNCING = {
    "_local_scalar_dense",
    "nonzero",
    "masked_select",
    "unique",
    "_unique2",
    "unique_consecutive",
    "bincount",
    "equal",
    "is_nonzero",
}


class HostReads(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves it untyped
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        counted = name in SYNCING or (
            func is torch.ops.aten.repeat_interleave.Tensor
            and (kwargs or {}).get("output_size") is None
        )
        if counted and not _on_the_device():
            self.seen.append(f"{func} from {_caller()}")
        return func(*args, **(kwargs or {}))


# Code that stands for the device itself: the stand-in's torch_npu ops (their argument checks
# read values, as the real ops do on the device) and Triton's interpreter (a kernel's body).
DEVICE_CODE = ("torch_npu_standin", f"triton{os.sep}runtime{os.sep}interpreter")


def _on_the_device() -> bool:
    frame: Any = sys._getframe(2)
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in DEVICE_CODE):
            return True
        frame = frame.f_back
    return False


def _caller() -> str:
    """The innermost frame of this code base that issued the op."""
    frame: Any = sys._getframe(2)
    while frame is not None:
        if f"{os.sep}tandem{os.sep}" in frame.f_code.co_filename:
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


MODELS: dict[str, Callable[[Path], Path]] = {
    "dense": lambda d: write_demo_model(d, tiny_spec()),
    "hybrid": lambda d: write_qwen3_5_demo_model(
        d,
        Qwen3_5DemoSpec(
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            full_attention_interval=2,
            head_dim=32,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            vocab_size=512,
        ),
    ),
    "moe": lambda d: write_qwen3_moe_demo_model(
        d,
        Qwen3MoeDemoSpec(hidden_size=64, num_layers=2, moe_intermediate_size=64, vocab_size=512),
    ),
}


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.usefixtures("standin_torch_npu")
def test_the_npu_forward_reads_nothing_back(tmp_path: Path, kind: str) -> None:
    folder = MODELS[kind](tmp_path / kind)
    config = EngineConfig(
        model=ModelLoadConfig(model=str(folder), dtype="bfloat16"),
        cache=CacheConfig(num_blocks=64),
    )
    runtime = FakeNpuRuntime(REAL_SYNC, kernel_families=("torch_npu", "triton"))
    worker: Worker[Any, Any] = Worker(
        Device("npu", 0), SingleRankGroup(), config,
        LLMRunnerFactory(load_model_config(folder)), runtime=runtime,
        kernel_registry=KernelRegistry(),
    )  # fmt: skip
    reads = HostReads()
    errors: list[BaseException] = []

    def on_the_worker_thread() -> None:
        try:
            worker.init_device()
            worker.load_model()
            worker.init_kv_cache(CacheSize(num_blocks=64, num_state_slots=8))
            runner = worker.runner
            assert isinstance(runner, ModelRunner)
            forward = runner.model.forward

            def watched(*args: Any) -> Any:
                with reads:
                    return forward(*args)

            runner.model.forward = watched  # type: ignore[method-assign, assignment]
            gen = torch.Generator().manual_seed(0)
            for decodes, prefills in (([], [(0, 9), (0, 5)]), ([10, 6], [(16, 7)])):
                step = make_step(decodes, prefills, block_size=16, num_blocks=64, gen=gen)
                slots = torch.arange(1, step.query_lens.shape[0] + 1)
                step = step.__class__(**{**vars(step), "state_slots": slots})
                runner.execute(step)
        except BaseException as exc:  # noqa: BLE001  # reported on the test's thread
            errors.append(exc)

    thread = threading.Thread(target=on_the_worker_thread)
    thread.start()
    thread.join(300)
    assert not errors, errors
    assert not reads.seen, f"ops that sync with the host on a device: {sorted(set(reads.seen))}"
    families = {impl.__module__.split(".")[3] for impl in runtime.loaded.values()}
    assert "npu" in families


def test_the_watch_sees_a_read_back() -> None:
    reads = HostReads()
    t = torch.arange(4)
    with reads:
        int(t.max())
        t.nonzero()
        t.repeat_interleave(torch.tensor([1, 2, 1, 0]))
        t.repeat_interleave(2)  # an int count: the size is known, no read
    assert [seen.split(" from ")[0] for seen in reads.seen] == [
        "aten._local_scalar_dense.default",
        "aten.nonzero.default",
        "aten.repeat_interleave.Tensor",
    ]
