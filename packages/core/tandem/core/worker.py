"""A worker owns one device: it binds it on its own thread, loads its shard of the model,
holds its KV cache and runs steps. Every method runs on the worker's thread."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from tandem.collectives import ProcessGroup, ReduceOp
from tandem.core.config import EngineConfig
from tandem.core.forward_input import ForwardInput, SamplerOutput
from tandem.core.kv_cache import bytes_per_block, num_blocks_for_memory
from tandem.core.model_runner import ModelRunner
from tandem.core.models.loader import load_model, resolve_dtype
from tandem.core.models.model_config import ModelConfig
from tandem.device import (
    BoundContext,
    Device,
    DeviceRuntime,
    KernelRegistry,
    bind_context,
    get_runtime,
    process_kernel_registry,
)

logger = logging.getLogger(__name__)


class Worker:
    def __init__(
        self,
        device: Device,
        group: ProcessGroup,
        config: EngineConfig,
        model_config: ModelConfig,
        runtime: DeviceRuntime | None = None,
        kernel_registry: KernelRegistry[Any] | None = None,
    ) -> None:
        self.device = device
        self.group = group
        self.config = config
        self.model_config = model_config
        self.runtime: DeviceRuntime | None = runtime
        # Not `or`: an empty registry is falsy (it has a length).
        self._kernel_registry = (
            kernel_registry if kernel_registry is not None else process_kernel_registry()
        )
        self._runner: ModelRunner | None = None

    @property
    def runner(self) -> ModelRunner:
        if self._runner is None:
            raise RuntimeError("the worker has no model yet; call load_model() first")
        return self._runner

    def _torch_device(self) -> torch.device:
        assert self.runtime is not None, "init_device() first"
        device: torch.device = self.runtime.torch_device(self.device)
        return device

    def init_device(self, cpu_threads: int | None = None) -> None:
        """Bind the device to this thread; on CPU, also cap torch's threads for this worker
        (workers sharing the cores each take their share instead of all of them)."""
        if self.runtime is None:
            self.runtime = get_runtime(self.device.kind)
        self.runtime.bind(self.device)
        bind_context(BoundContext(self.runtime, self._kernel_registry))
        if self.device.kind == "cpu" and cpu_threads is not None:
            torch.set_num_threads(cpu_threads)

    def load_model(self) -> None:
        dtype = resolve_dtype(
            self.config.model.dtype, self.model_config.checkpoint_dtype, self.device.kind
        )
        model = load_model(
            Path(self.config.model.model),
            self.model_config,
            self.group,
            dtype,
            self._torch_device(),
        )
        self._runner = ModelRunner(
            model,
            self._torch_device(),
            dtype,
            seed=self.config.model.seed,
            samples=self.group.rank == 0,
        )

    def determine_num_blocks(self) -> int:
        assert self.runtime is not None
        runner = self.runner
        layer = runner.model.attention_layers()[0]
        block_bytes = bytes_per_block(
            len(runner.model.attention_layers()),
            layer.num_kv_heads,
            layer.head_dim,
            self.config.cache.block_size,
            runner.dtype,
        )
        return num_blocks_for_memory(
            self.config.cache,
            self.device,
            self.runtime.memory_info(self.device),
            runner.weight_bytes(),
            block_bytes,
        )

    def agree_num_blocks(self, num_blocks: int) -> int:
        """The smallest block count over all ranks, so every rank's cache holds every block."""
        if self.group.size == 1:
            return num_blocks
        # On the device: hardware collectives take device memory only.
        value = torch.tensor([-num_blocks], dtype=torch.int64, device=self._torch_device())
        self.group.all_reduce(value, ReduceOp.MAX)
        return -int(value.item())

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.init_kv_cache(num_blocks, self.config.cache.block_size)

    def execute_model(self, fi: ForwardInput) -> SamplerOutput | None:
        return self.runner.execute(fi)
