"""Group construction, written once for both executors: joining the process world, the group
among processes (one per device, or one per node), and one communicator set for every device
of a process, created at once."""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch.distributed as dist

from tandem.collectives import (
    ProcessGroup,
    Rendezvous,
    TorchDistributedGroup,
    create_inprocess_groups,
    init_distributed,
)
from tandem.collectives.backends import (
    CommunicatorSet,
    CrossProcessGroup,
    get_collective_backend,
)
from tandem.core.errors import ConfigError
from tandem.core.parallel.collective_choice import INPROCESS, TORCH, CollectiveChoice
from tandem.device import Device, DeviceRuntime
from tandem.device.sync import Sync

logger = logging.getLogger(__name__)


class Abortable(Protocol):
    def abort(self, reason: str) -> None: ...


@dataclass(frozen=True)
class CommunicatorHandles:
    """One communicator set of this process: how to release ranks blocked in it, and (for
    hardware libraries) how to free it once no thread uses it."""

    abortable: Abortable | None
    closeable: CommunicatorSet | None


NO_COMMUNICATOR = CommunicatorHandles(abortable=None, closeable=None)


# Seconds the processes may take to meet and load, whatever the step timeout: spawning and
# loading take long on a busy machine, and a step timeout of seconds must not cut them off.
STARTUP_TIMEOUT_S = 300.0


def join_process_world(
    address: str, world_size: int, rank: int, choice: CollectiveChoice, timeout_s: float
) -> None:
    """Meet the other processes at ``address`` (HOST:PORT or torchrun's env://), waiting
    ``STARTUP_TIMEOUT_S`` at least."""
    try:
        rdzv = Rendezvous.parse(address, world_size, rank)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    init_distributed(rdzv, choice.dist_backend, timeout_s=max(timeout_s, STARTUP_TIMEOUT_S))


def make_process_group(
    choice: CollectiveChoice,
    device: Device,
    runtime: DeviceRuntime,
    rank: int,
    size: int,
    timeout_s: float,
) -> tuple[ProcessGroup, CommunicatorHandles]:
    """The group among processes: torch.distributed's (its collectives time out after
    ``timeout_s``, the step timeout; destroy_process_group tears it down), or the library's
    communicator made from an id rank 0 shares over the world group, with the handles that
    close it."""
    if choice.process == TORCH:
        steps = dist.new_group(
            backend=choice.dist_backend, timeout=datetime.timedelta(seconds=timeout_s)
        )
        return TorchDistributedGroup(choice.dist_backend, group=steps), NO_COMMUNICATOR
    made = get_collective_backend(choice.process).process_group(
        device, runtime, rank, size, timeout_s
    )
    if not isinstance(made, CrossProcessGroup):
        # A plugin written to the older protocol: its communicator would never be closed.
        raise ConfigError(
            f"the collective backend {choice.process!r} returned {type(made).__name__} from "
            "process_group; it must return CrossProcessGroup(group, communicators) "
            "(tandem.collectives.backends), so that the communicator is closed"
        )
    return made.group, CommunicatorHandles(made.communicators, made.communicators)


def close_communicators(handles: Sequence[CommunicatorHandles], reason: str) -> None:
    """Close every set that can be closed, each on its own: a failure is logged and the rest
    are still closed. Call only once no thread uses them (else abort them with ``reason``)."""
    for comms in handles:
        if comms.closeable is None:
            continue
        try:
            comms.closeable.close()
        except Exception:
            logger.exception("a communicator set could not be closed (%s)", reason)


def make_local_groups(
    choice: CollectiveChoice,
    devices: Sequence[Device],
    runtime: DeviceRuntime,
    timeout_s: float,
    sync: Sync,
) -> tuple[list[ProcessGroup], CommunicatorHandles]:
    """One communicator set for every device of this process, created at once: in host
    memory (inprocess), or the library's ``*CommInitAll``."""
    if choice.local == INPROCESS:
        inprocess = create_inprocess_groups(len(devices), timeout_s=timeout_s, sync=sync)
        return list(inprocess), CommunicatorHandles(inprocess[0].communicator, None)
    made = get_collective_backend(choice.local).local_groups(list(devices), runtime, timeout_s)
    return made.groups, CommunicatorHandles(made.communicators, made.communicators)
