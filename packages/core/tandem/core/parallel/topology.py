"""Decide, before anything starts, how the workers are laid out, and refuse layouts that
cannot work with a message that says what to do instead."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

from tandem.core.config import ParallelConfig
from tandem.core.errors import ConfigError
from tandem.device import Device, parse_devices

SINGLE_PROCESS_HINT = "set TANDEM_ENABLE_SINGLE_PROCESS=1 (or --single-process)"


class Mode(enum.Enum):
    # All local devices driven by worker threads of this process.
    SINGLE_PROCESS = "single-process"
    # One process per device, joined through torch.distributed.
    MULTI_PROCESS = "multi-process"


@dataclass(frozen=True)
class Topology:
    mode: Mode
    devices: tuple[Device, ...]  # this node's
    nnodes: int
    node_rank: int
    master_node_addr: str | None

    @property
    def local_size(self) -> int:
        return len(self.devices)

    @property
    def world_size(self) -> int:
        return self.local_size * self.nnodes

    @property
    def first_rank(self) -> int:
        return self.node_rank * self.local_size

    @property
    def uses_local_groups(self) -> bool:
        """Several devices of this node share one communicator set (worker threads)."""
        return self.mode is Mode.SINGLE_PROCESS and self.local_size > 1

    @property
    def uses_process_groups(self) -> bool:
        """Collectives cross process boundaries (one process per device, or node leaders)."""
        return self.world_size > 1 and (self.mode is Mode.MULTI_PROCESS or self.nnodes > 1)

    def cpu_threads_per_worker(self) -> int | None:
        """CPU workers split this machine's cores; None leaves torch's default."""
        if self.devices[0].kind != "cpu" or self.local_size == 1:
            return None
        return max(1, (os.cpu_count() or 1) // self.local_size)


def resolve_topology(config: ParallelConfig) -> Topology:
    try:
        devices = tuple(parse_devices(config.devices))
    except ValueError as exc:
        raise ConfigError(f"--devices: {exc}") from None
    world = len(devices) * config.nnodes
    if config.tensor_parallel_size is not None and config.tensor_parallel_size != world:
        raise ConfigError(
            f"--tensor-parallel-size {config.tensor_parallel_size} does not match the devices: "
            f"{len(devices)} per node x {config.nnodes} nodes = {world}; list one device per "
            "rank in --devices (e.g. --devices cpu:0,cpu:1 for 2) or change the size"
        )
    single, master = config.single_process, config.master_node_addr
    if world == 1 and not master:
        # One device, one worker: there is no topology to choose.
        return Topology(Mode.SINGLE_PROCESS, devices, 1, 0, None)
    if not single and not master:
        raise ConfigError(
            f"{world} ranks need a topology: {SINGLE_PROCESS_HINT} for one process driving "
            "every local device, or --master-node-addr HOST:PORT for one process per device"
        )
    if single and master and config.nnodes == 1:
        raise ConfigError(
            "single-process mode on one node needs no --master-node-addr; drop it, or give "
            "--nnodes N --node-rank R to run one process on each of N nodes"
        )
    if single and config.nnodes > 1 and not master:
        raise ConfigError(
            f"--nnodes {config.nnodes} needs --master-node-addr HOST:PORT of node 0 for the "
            "nodes to meet"
        )
    if single and config.local_collectives == "torch":
        raise ConfigError(
            f"single-process mode cannot use {config.local_collectives!r} collectives among "
            "local devices: torch.distributed's default group is process-global and cannot "
            "host two ranks in one process; use a communicator created for all local devices at "
            "once (--local-collectives auto: inprocess on CPU, hccl on NPU, nccl on CUDA) or "
            "one process per device (--master-node-addr)"
        )
    if master == "env://" and not single:
        raise ConfigError(
            "under torchrun, start one Tandem process per node (--nproc-per-node 1) with "
            f"{SINGLE_PROCESS_HINT}; one process per device is spawned by Tandem itself "
            "(--master-node-addr HOST:PORT)"
        )
    mode = Mode.SINGLE_PROCESS if single else Mode.MULTI_PROCESS
    return Topology(mode, devices, config.nnodes, config.node_rank, master)
