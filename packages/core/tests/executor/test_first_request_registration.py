"""The acceptance asked for in xLLM pull request #1894's review, on CPU: a hybrid model at TP=2
in one process, three cold starts, and the first request reaching both workers at once, so that
both register the linear-attention kernels concurrently. Every (kernel, device) is registered
exactly once, no registration fails, and the tokens are TP=1's.

The CPU runtime here counts registrations per (kernel, device), refuses a second one the way
the NPU runtime does (507028), and holds each worker at a barrier on its first use of each
linear-attention kernel until the other worker gets there too: both are then inside the
registry for the same kernel at the same moment, as the two workers of that review's
Qwen3.5-27B crash were.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandem.core import LLMEngine, SamplingParams
from tandem.core.config import ParallelConfig
from tandem.core.executor.thread_executor import ThreadExecutor
from tandem.core.llm.model_runner import LLMRunnerFactory
from tandem.core.parallel.topology import resolve_topology
from tandem.device import Device, KernelRegistry
from tandem.device.cpu import CpuRuntime

from ..conftest import EngineFactory, engine_config

LINEAR_ATTENTION_KERNELS = (
    "causal_conv1d_prefill",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "recurrent_gated_delta_rule",
    "rms_norm_gated",
    "gdn_gating",
)
PROMPTS = [[5, 17, 300, 42, 9, 100, 7], [3, 9, 27, 81, 243, 11, 33, 99, 297, 2, 6, 18, 54]]
PARAMS = SamplingParams.greedy(max_tokens=24, ignore_eos=True)
ACL_ERROR_RT_KERNEL_DUPLICATE = 507028


class CountingCpuRuntime(CpuRuntime):
    def __init__(self, num_workers: int) -> None:
        super().__init__()
        self.loads: Counter[tuple[str, Device]] = Counter()
        self._lock = threading.Lock()
        self._barriers = {
            name: threading.Barrier(num_workers, timeout=60) for name in LINEAR_ATTENTION_KERNELS
        }

    def load_kernel(
        self, name: str, impl: Callable[..., Any], device: Device
    ) -> Callable[..., Any]:
        barrier = self._barriers.get(name)
        if barrier is not None:
            # A registry that serialized registration behind one lock would hang here.
            barrier.wait()
        with self._lock:
            self.loads[(name, device)] += 1
            if self.loads[(name, device)] > 1:
                raise RuntimeError(
                    f"rtFunctionRegister failed for kernel '{name}' on {device}: "
                    f"error={ACL_ERROR_RT_KERNEL_DUPLICATE}"
                )
        return super().load_kernel(name, impl, device)


def test_three_cold_starts_register_each_kernel_once_per_device(
    hybrid_dir: Path, make_engine: EngineFactory
) -> None:
    reference = [o.token_ids for o in make_engine(hybrid_dir).generate(PROMPTS, PARAMS)]
    config = engine_config(
        hybrid_dir, parallel=ParallelConfig(devices="cpu:0,cpu:1", single_process=True)
    )
    devices = [Device("cpu", 0), Device("cpu", 1)]
    for start in range(3):
        runtime = CountingCpuRuntime(num_workers=2)
        registry: KernelRegistry[Any] = KernelRegistry()
        executor: ThreadExecutor[Any, Any] = ThreadExecutor(
            config,
            LLMRunnerFactory.from_folder(hybrid_dir),
            resolve_topology(config.parallel),
            runtime=runtime,
            kernel_registry=registry,
        )
        engine = LLMEngine(config, executor=executor)
        try:
            outs = engine.generate(PROMPTS, PARAMS)
        finally:
            engine.shutdown()
        assert [o.error for o in outs] == [None, None], f"cold start {start}"
        assert [o.token_ids for o in outs] == reference, f"cold start {start}"
        assert set(runtime.loads.values()) == {1}, f"cold start {start}: {runtime.loads}"
        for name in LINEAR_ATTENTION_KERNELS:
            assert all(runtime.loads[(name, d)] == 1 for d in devices), (start, name)
        assert registry.registrations == len(runtime.loads) == len(registry)
