"""A worker owns one device: it binds it on its own thread, loads its shard of a product's
model through the product's runner factory, holds its KV cache and runs steps, one at a time
on its own thread or several at once in pipeline lanes that share the weights. It knows steps
only as what the runner takes: nothing here depends on the product."""

from __future__ import annotations

import logging
from typing import Any, Generic

import torch

from tandem.collectives import ProcessGroup, ReduceOp
from tandem.collectives.thread_bound import ThreadBoundGroup
from tandem.core.config import EngineConfig
from tandem.core.faults import NO_FAULTS
from tandem.core.kernels.cpu.startup import preparing_cpu_kernels
from tandem.core.kernels.cpu.vml_dispatch import resolve_vml_dispatch
from tandem.core.kv.cache_sizing import CacheCosts, CacheSize, size_cache
from tandem.core.worker.lane import Lane
from tandem.core.worker.lane_stager import LaneStager, Staged
from tandem.core.worker.step_runner import (
    LaneState,
    MemoryFootprint,
    OutT,
    RunnerContext,
    RunnerFactory,
    StepRunner,
    StepT,
)
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


class Worker(Generic[StepT, OutT]):
    def __init__(
        self,
        device: Device,
        group: ProcessGroup,
        config: EngineConfig,
        runner_factory: RunnerFactory[StepT, OutT],
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
        self.rank = group.rank
        # Injected faults (tests only): no-op hooks unless TANDEM_FAULTS named some.
        faults = config.faults
        self._faults = faults.for_rank(self.rank) if faults.active else NO_FAULTS
        group = self._faults.wrap_group(group)
        lane_groups = [self._faults.wrap_group(g) for g in lane_groups or []]
        self.runtime: DeviceRuntime | None = (
            None if runtime is None else self._faults.wrap_runtime(runtime)
        )
        self._factory = runner_factory
        self._lane_groups = ThreadBoundGroup(lane_groups) if lane_groups else None
        self.group: ProcessGroup = self._lane_groups if self._lane_groups is not None else group
        self._sync = sync
        # Not `or`: an empty registry is falsy (it has a length).
        self._kernel_registry = (
            kernel_registry if kernel_registry is not None else process_kernel_registry()
        )
        self._runner: StepRunner[StepT, OutT] | None = None
        # The worker thread's own state, for steps run without lanes.
        self._state: LaneState = {}
        self.lanes: list[Lane] = []
        self.memory = MemoryFootprint(weight_bytes=0, kv_cache_bytes=0)

    @property
    def runner(self) -> StepRunner[StepT, OutT]:
        if self._runner is None:
            raise RuntimeError("the worker has no model; call load_model() first")
        return self._runner

    def _torch_device(self) -> torch.device:
        assert self.runtime is not None, "init_device() first"
        device: torch.device = self.runtime.torch_device(self.device)
        return device

    def init_device(self, cpu_threads: int | None = None) -> None:
        """Settle oneMKL's vector math dispatch for the process (on every device kind: any
        float math on host tensors goes through it), bind the device to this thread; on CPU,
        also cap torch's threads for this worker (workers sharing the cores each take their
        share)."""
        # Before this worker computes anything: its first vector math calls would otherwise race
        # the other workers' (and its own intra-op threads') and may run a low-accuracy kernel.
        resolve_vml_dispatch()
        if self.runtime is None:
            self.runtime = self._faults.wrap_runtime(get_runtime(self.device.kind))
        self.runtime.bind(self.device)
        bind_context(BoundContext(self.runtime, self._kernel_registry))
        if self._lane_groups is not None:
            # The worker thread speaks for lane 0 (it never runs while lanes do).
            self._lane_groups.bind(0)
        if self.device.kind == "cpu" and cpu_threads is not None:
            torch.set_num_threads(cpu_threads)

    def load_model(self) -> None:
        context = RunnerContext(self.device, self._torch_device(), self.group, self.config)
        # On CPU the kernel libraries build beside the load, and are in place before the
        # worker reports loaded: the server is not ready (/health) until they are.
        with preparing_cpu_kernels(self.device.kind):
            self._runner = self._factory(context)

    def determine_cache_size(self) -> CacheSize:
        """KV blocks and state slots that fit this rank's memory budget beside its weights."""
        assert self.runtime is not None
        runner = self.runner
        costs = CacheCosts(
            weight_bytes=runner.weight_bytes(),
            block_bytes=runner.block_bytes(self.config.cache.block_size),
            state_slot_bytes=runner.state_slot_bytes(),
        )
        self.memory = MemoryFootprint(costs.weight_bytes, kv_cache_bytes=0)
        spec = self.config.speculative
        return size_cache(
            self.config.cache,
            self.config.scheduler.max_seqs_per_batch,
            self.device,
            self.runtime.memory_info(self.device),
            costs,
            runner.block_demand(self.config.cache.block_size),
            scratch_per_slot=spec.num_speculative_tokens if spec is not None else 0,
        )

    def agree_cache_size(self, size: CacheSize) -> CacheSize:
        """The smallest counts over all ranks, so every rank's cache holds every block and
        every slot."""
        if self.group.size == 1:
            return size
        # On the device: hardware collectives take device memory only.
        value = torch.tensor(
            [-size.num_blocks, -size.num_state_slots, -size.num_state_snapshots],
            dtype=torch.int64,
            device=self._torch_device(),
        )
        self.group.all_reduce(value, ReduceOp.MAX)
        blocks, slots, snapshots = (-int(v) for v in value.tolist())
        # Scratch rows go with the slots (the same number per slot on every rank).
        per_slot = size.num_state_scratch // size.num_state_slots if size.num_state_slots else 0
        return CacheSize(blocks, slots, snapshots, slots * per_slot)

    def init_kv_cache(self, size: CacheSize) -> None:
        block_size = self.config.cache.block_size
        runner = self.runner
        runner.init_kv_cache(size, block_size, prefault=self.config.cache.prefault_kv_cache)
        self.memory = MemoryFootprint(
            runner.weight_bytes(),
            kv_cache_bytes=size.num_blocks * runner.block_bytes(block_size),
            state_cache_bytes=size.num_state_rows * runner.state_slot_bytes(),
        )

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

    def execute(self, step: StepT) -> OutT | None:
        """Run ``step`` on the calling thread (the worker's own)."""
        self._faults.before_forward(self.rank, self._faults.next_step())
        return self.runner.execute(step, self._state)

    def submit(self, lane: int, step: StepT) -> Promise[OutT | None]:
        """Run ``step`` on pipeline lane ``lane``: staged by the lane's host thread, run by its
        stream; the result once the stream has run it. Every step of one batch goes to the
        same lane, whose state the runner may keep across them."""
        runner, chosen = self.runner, self.lanes[lane]
        faults, index = self._faults, self._faults.next_step()

        def prepare(stager: LaneStager) -> tuple[StepT, Staged | None]:
            return runner.stage(step, stager)

        def forward(own: StepT) -> OutT | None:
            faults.before_forward(self.rank, index)
            return runner.execute(own, chosen.state)

        return chosen.run(prepare, forward)
