"""The one seam between the execution layer and a product.

A product (LLM serving, generative recommendation) hands the executor a runner factory; each
worker calls it once on its own thread, with its device bound, to load its shard of the
product's model into a ``StepRunner``. From then on the worker, its lanes and both executors
move opaque *steps* to the runner and its *outputs* back: none of them asks which product a
step belongs to. Factories cross process boundaries (one process per device), so they are
small picklable objects that carry configuration only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from tandem.collectives import ProcessGroup
from tandem.core.config import EngineConfig
from tandem.core.kv.cache_sizing import CacheSize
from tandem.core.kv.kv_cache import BlockDemand
from tandem.core.worker.lane_stager import LaneStager, Staged
from tandem.device import Device

StepT = TypeVar("StepT")
OutT = TypeVar("OutT")
OutT_co = TypeVar("OutT_co", covariant=True)

# What a runner keeps across the steps one lane runs (the recommender's beams per batch);
# every lane has its own, and the worker thread one more.
LaneState = dict[int, Any]


@dataclass(frozen=True)
class RunnerContext:
    """What a worker hands the factory: its device, bound on the calling thread, and the
    tensor-parallel group (with lanes, it reaches the calling lane's communicator set)."""

    device: Device
    torch_device: torch.device
    group: ProcessGroup
    config: EngineConfig


class StepRunner(Protocol[StepT, OutT_co]):
    def weight_bytes(self) -> int:
        """Bytes this rank's weights take (tied weights counted once)."""
        ...

    def block_bytes(self, block_size: int) -> int:
        """Bytes one KV block of ``block_size`` positions takes on this rank."""
        ...

    def state_slot_bytes(self) -> int:
        """Bytes one sequence's linear-attention state takes on this rank (0: the model keeps
        no per-sequence state)."""
        ...

    def block_demand(self, block_size: int) -> BlockDemand | None:
        """The most KV blocks of ``block_size`` positions the product's scheduler can hold at
        once (the cache is sized no larger); None: as many as memory allows."""
        ...

    def init_kv_cache(self, size: CacheSize, block_size: int, prefault: bool) -> None:
        """Allocate ``size.num_blocks`` KV blocks and ``size.num_state_slots`` state slots;
        ``prefault``: back a host cache's pages with memory now, not at first write."""
        ...

    def stage(self, step: StepT, stager: LaneStager) -> tuple[StepT, Staged | None]:
        """The step with its input tensors copied through the lane's ``stager`` (work handed
        to another thread owns its inputs), and what to release once the forward is queued;
        ``None`` when the step has nothing to stage."""
        ...

    def execute(self, step: StepT, state: LaneState) -> OutT_co | None:
        """Run one step; ``None`` on ranks that do not answer (rank 0 answers for all)."""
        ...


# Loads this rank's shard of a product's model onto the context's device.
RunnerFactory = Callable[[RunnerContext], StepRunner[StepT, OutT]]


@dataclass(frozen=True)
class MemoryFootprint:
    """What one rank's model and caches take, for logs, metrics and benchmarks."""

    weight_bytes: int
    kv_cache_bytes: int
    state_cache_bytes: int = 0
