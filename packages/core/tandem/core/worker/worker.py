"""A worker owns one device: it binds it on its own thread, loads its shard of the model
(an LLM or a recommender), holds its KV cache and runs steps, one at a time on its own thread
or several at once in pipeline lanes that share the weights."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tandem.collectives import ProcessGroup, ReduceOp
from tandem.collectives.thread_bound import ThreadBoundGroup
from tandem.core.config import EngineConfig
from tandem.core.kv.kv_cache import bytes_per_block, num_blocks_for_memory
from tandem.core.llm.forward_input import ForwardInput, SamplerOutput
from tandem.core.llm.model_runner import ModelRunner
from tandem.core.models.loader import load_model, resolve_dtype
from tandem.core.models.model_config import ModelConfig
from tandem.core.models.rec_config import RecModelConfig
from tandem.core.models.rec_loader import load_rec_model
from tandem.core.rec.catalog import load_catalog
from tandem.core.rec.runner import RecModelRunner
from tandem.core.rec.step import RecPrefill, RecStep, RecStepOutput
from tandem.core.worker.lane import Lane
from tandem.core.worker.lane_stager import LaneStager, Staged
from tandem.device import (
    BoundContext,
    Device,
    DeviceRuntime,
    KernelRegistry,
    bind_context,
    get_runtime,
    process_kernel_registry,
)
from tandem.device.scratch_allocator import ScratchAllocator
from tandem.device.sync import REAL_SYNC, Promise, Sync

logger = logging.getLogger(__name__)


AnyModelConfig = ModelConfig | RecModelConfig


class Worker:
    def __init__(
        self,
        device: Device,
        group: ProcessGroup,
        config: EngineConfig,
        model_config: AnyModelConfig,
        runtime: DeviceRuntime | None = None,
        kernel_registry: KernelRegistry[Any] | None = None,
        lane_groups: list[ProcessGroup] | None = None,
        sync: Sync = REAL_SYNC,
    ) -> None:
        """``lane_groups``: one group per pipeline lane (``max_concurrency`` of them); the
        model then reaches the calling lane's group, and ``group`` serves the worker thread
        (loading, agreeing on the cache size)."""
        self.device = device
        self.config = config
        self.model_config = model_config
        self.runtime: DeviceRuntime | None = runtime
        self._lane_groups = ThreadBoundGroup(lane_groups) if lane_groups else None
        self.group: ProcessGroup = self._lane_groups if self._lane_groups is not None else group
        self._sync = sync
        # Not `or`: an empty registry is falsy (it has a length).
        self._kernel_registry = (
            kernel_registry if kernel_registry is not None else process_kernel_registry()
        )
        self._runner: ModelRunner | None = None
        self._rec_runner: RecModelRunner | None = None
        self.lanes: list[Lane] = []

    @property
    def runner(self) -> ModelRunner:
        if self._runner is None:
            raise RuntimeError("the worker has no LLM; call load_model() first")
        return self._runner

    @property
    def rec_runner(self) -> RecModelRunner:
        if self._rec_runner is None:
            raise RuntimeError("the worker has no recommender; call load_model() first")
        return self._rec_runner

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
        if self._lane_groups is not None:
            # The worker thread speaks for lane 0 (it never runs while lanes do).
            self._lane_groups.bind(0)
        if self.device.kind == "cpu" and cpu_threads is not None:
            torch.set_num_threads(cpu_threads)

    def load_model(self) -> None:
        folder = Path(self.config.model.model)
        mc = self.model_config
        checkpoint_dtype = mc.torch_dtype if isinstance(mc, RecModelConfig) else mc.checkpoint_dtype
        dtype = resolve_dtype(self.config.model.dtype, checkpoint_dtype, self.device.kind)
        if isinstance(mc, RecModelConfig):
            rec = load_rec_model(folder, mc, self.group, dtype, self._torch_device())
            catalog = load_catalog(folder, mc.codebook_size)
            self._rec_runner = RecModelRunner(rec, catalog, self._torch_device(), dtype)
            return
        model = load_model(folder, mc, self.group, dtype, self._torch_device())
        self._runner = ModelRunner(
            model,
            self._torch_device(),
            dtype,
            seed=self.config.model.seed,
            samples=self.group.rank == 0,
        )

    def determine_num_blocks(self) -> int:
        assert self.runtime is not None
        if self._rec_runner is not None:
            weight_bytes = self._rec_runner.weight_bytes()
            block_bytes = self._rec_runner.block_bytes(self.config.cache.block_size)
        else:
            runner = self.runner
            layer = runner.model.attention_layers()[0]
            weight_bytes = runner.weight_bytes()
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
            weight_bytes,
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
        if self._rec_runner is not None:
            self._rec_runner.init_kv_cache(num_blocks, self.config.cache.block_size)
        else:
            self.runner.init_kv_cache(num_blocks, self.config.cache.block_size)

    def init_lanes(self) -> None:
        """The pipeline lanes (``max_concurrency`` of them), each with its own threads."""
        assert self.runtime is not None
        pipeline = self.config.pipeline
        allocator = ScratchAllocator(self._torch_device(), self._sync)
        prepare_lock = self._sync.lock() if pipeline.serialize_prepare else None
        forward_lock = self._sync.lock() if pipeline.serialize_forward else None
        self.lanes = [
            Lane(
                i,
                self.device,
                self.runtime,
                self._kernel_registry,
                self._lane_groups,
                allocator,
                prepare_lock,
                forward_lock,
                self._sync,
            )
            for i in range(pipeline.max_concurrency)
        ]

    def stop_lanes(self) -> None:
        for lane in self.lanes:
            lane.stop()

    def execute_model(self, fi: ForwardInput) -> SamplerOutput | None:
        return self.runner.execute(fi)

    def submit_model(self, lane: int, fi: ForwardInput) -> Promise[SamplerOutput | None]:
        """Run ``fi`` on pipeline lane ``lane``; the result once its stream has run it."""

        def prepare(stager: LaneStager) -> tuple[ForwardInput, Staged]:
            staged = stager.stage(
                [fi.input_ids, fi.positions, fi.slot_mapping, fi.query_lens, fi.context_lens,
                 fi.block_tables, fi.sample_indices]
            )  # fmt: skip
            ids, positions, kv_slots, qlens, clens, tables, samples = staged.tensors
            own = replace(
                fi, input_ids=ids, positions=positions, slot_mapping=kv_slots, query_lens=qlens,
                context_lens=clens, block_tables=tables, sample_indices=samples,
            )  # fmt: skip
            return own, staged

        return self.lanes[lane].run(prepare, self.runner.execute)

    def submit_rec(self, lane: int, step: RecStep) -> Promise[RecStepOutput]:
        """Run one step of a recommendation batch on lane ``lane`` (every step of a batch goes
        to the same lane, which keeps the batch's beams)."""
        runner = self.rec_runner
        state = self.lanes[lane].state

        def prepare(stager: LaneStager) -> tuple[RecStep, Staged | None]:
            p = step.prefill
            if p is None:
                return step, None
            staged = stager.stage([p.histories, p.lengths, p.block_tables, p.beam_widths])
            h, lengths, tables, widths = staged.tensors
            own = RecPrefill(h, lengths, tables, widths, p.num_candidates)
            return replace(step, prefill=own), staged

        return self.lanes[lane].run(prepare, lambda s: runner.execute(s, state))
