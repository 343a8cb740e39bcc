"""Which collectives each layer of the topology uses, chosen from the device kind unless the
flags name one, and checked before any worker starts (library present, device kind served)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.collectives.backends import get_collective_backend
from tandem.core.config import ParallelConfig
from tandem.core.errors import ConfigError

# Built into the executors; every other name is an installed backend (tandem-hw: hccl, nccl).
INPROCESS = "inprocess"
TORCH = "torch"

_LOCAL_AUTO = {"cpu": INPROCESS, "npu": "hccl", "cuda": "nccl"}
_PROCESS_AUTO = {"cpu": TORCH, "npu": "hccl", "cuda": "nccl"}
_TORCH_BACKEND = {"cpu": "gloo", "npu": "hccl", "cuda": "nccl"}


@dataclass(frozen=True)
class CollectiveChoice:
    # Among the devices of one single-process node.
    local: str
    # Among processes (one per device, or the node leaders of a multi-node run).
    process: str
    # torch.distributed backend of the world group: the collectives themselves when
    # ``process`` is "torch", else only the CPU group that exchanges the communicator id.
    dist_backend: str


def resolve_collectives(
    config: ParallelConfig, device_kind: str, uses_local: bool, uses_process: bool
) -> CollectiveChoice:
    local = config.local_collectives
    if local == "auto":
        local = _LOCAL_AUTO[device_kind]
    process = config.process_collectives
    if process == "auto":
        process = _PROCESS_AUTO[device_kind]
    if process == INPROCESS:
        raise ConfigError(
            "the in-process communicator cannot span processes; use --process-collectives "
            "auto, torch, hccl or nccl"
        )
    dist_backend = config.dist_backend
    if dist_backend == "auto":
        dist_backend = _TORCH_BACKEND[device_kind] if process == TORCH else "gloo"
    elif uses_process and process != TORCH and dist_backend != "gloo":
        raise ConfigError(
            f"--process-collectives {process} exchanges its communicator id over a CPU group; "
            f"leave --dist-backend auto (or gloo), or use --process-collectives torch to run "
            f"the collectives on torch.distributed's {dist_backend} backend"
        )
    used = ([local] if uses_local else []) + ([process] if uses_process else [])
    for name in used:
        if name in (INPROCESS, TORCH):
            continue
        try:
            get_collective_backend(name).check(device_kind)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if uses_local and local == INPROCESS and device_kind != "cpu":
        raise ConfigError(
            f"the in-process communicator moves tensors through host memory and cannot serve "
            f"{device_kind} devices; use --local-collectives auto"
        )
    return CollectiveChoice(local, process, dist_backend)
