"""Which collectives each layer of the topology uses, chosen from the device kind unless the
flags name one, and checked before any worker starts (library present, device kind served).

"auto" on CPU is the built-in in-process communicator (one process) and torch.distributed's
gloo (between processes); on any other kind it is the installed backend that declares that
device kind (``tandem.collective_backends`` entry points: hccl for npu, nccl for cuda), so a
new device brings its collectives as a plugin and nothing here names it."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.collectives.backends import (
    CollectiveBackend,
    backend_for_device_kind,
    get_collective_backend,
    installed_backends,
)
from tandem.core.config import ParallelConfig
from tandem.core.errors import ConfigError

# Built into the executors; every other name is an installed backend (tandem-hw: hccl, nccl).
INPROCESS = "inprocess"
TORCH = "torch"

CPU = "cpu"


def local_collectives_choices() -> list[str]:
    """What --local-collectives takes: auto, the built-ins, every installed backend."""
    return ["auto", INPROCESS, TORCH, *installed_backends()]


def process_collectives_choices() -> list[str]:
    return ["auto", TORCH, *installed_backends()]


def _native(device_kind: str, used: bool) -> CollectiveBackend | None:
    """The backend "auto" means for ``device_kind``; None on CPU, or where none is installed
    and nothing will use it."""
    if device_kind == CPU:
        return None
    backend = backend_for_device_kind(device_kind)
    if backend is None and used:
        raise ConfigError(
            f"no installed collective backend serves {device_kind} devices (installed: "
            f"{', '.join(installed_backends()) or 'none'}); install the device's package "
            "(its tandem.collective_backends entry point), or run one device per engine"
        )
    return backend


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
        native = _native(device_kind, uses_local)
        local = native.name if native else INPROCESS
    process = config.process_collectives
    if process == "auto":
        native = _native(device_kind, uses_process)
        process = native.name if native else TORCH
    if process == INPROCESS:
        raise ConfigError(
            "the in-process communicator cannot span processes; use --process-collectives "
            f"auto or one of {', '.join(process_collectives_choices()[1:])}"
        )
    dist_backend = config.dist_backend
    if dist_backend == "auto":
        native = _native(device_kind, uses_process) if process == TORCH else None
        dist_backend = native.torch_dist_backend if native else "gloo"
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
