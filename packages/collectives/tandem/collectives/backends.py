"""Collective backends picked by name at start-up.

The in-process communicator (``inprocess.py``) and torch.distributed are built into the
executors. Hardware backends (``hccl``, ``nccl``) live in the
``tandem-hw`` distribution and announce themselves through the ``tandem.collective_backends``
entry-point group, so nothing here imports them by name.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Protocol

from tandem.collectives.process_group import ProcessGroup
from tandem.device import Device, DeviceRuntime

ENTRY_POINT_GROUP = "tandem.collective_backends"


class CommunicatorSet(Protocol):
    """The handle on every local rank's communicator: abort releases blocked ranks."""

    def abort(self, reason: str) -> None: ...

    def close(self) -> None:
        """Destroy the communicators once no rank uses them any more."""
        ...


@dataclass
class LocalGroups:
    groups: list[ProcessGroup]
    communicators: CommunicatorSet


@dataclass
class CrossProcessGroup:
    """This process's rank of a group spanning processes, and the communicator beneath it,
    which whoever made the group closes once no thread uses it."""

    group: ProcessGroup
    communicators: CommunicatorSet


class CollectiveBackend(Protocol):
    name: str
    # The device kind whose collectives this is ("auto" picks it for that kind), and the
    # torch.distributed backend of that kind (what --process-collectives torch runs there).
    device_kind: str
    torch_dist_backend: str

    def check(self, device_kind: str) -> None:
        """Fail before anything starts when this backend cannot serve ``device_kind`` here
        (library missing, wrong kind of device); raise ValueError saying what to do."""
        ...

    def local_groups(
        self, devices: Sequence[Device], runtime: DeviceRuntime, timeout_s: float
    ) -> LocalGroups:
        """One group per local device, created for all of them at once."""
        ...

    def process_group(
        self, device: Device, runtime: DeviceRuntime, rank: int, size: int, timeout_s: float
    ) -> CrossProcessGroup:
        """This process's rank of a group spanning processes. torch.distributed's default
        (CPU) group is already up and serves to exchange the communicator id."""
        ...


_loaded: dict[str, CollectiveBackend] = {}
_lock = threading.Lock()


def get_collective_backend(name: str) -> CollectiveBackend:
    """The installed backend called ``name`` (loaded from its entry point once)."""
    with _lock:
        if name in _loaded:
            return _loaded[name]
        found = entry_points(group=ENTRY_POINT_GROUP, name=name)
        for entry in found:
            backend: CollectiveBackend = entry.load()()
            _loaded[name] = backend
            return backend
    known = sorted(e.name for e in entry_points(group=ENTRY_POINT_GROUP)) or ["none"]
    raise ValueError(
        f"no collective backend named {name!r} is installed (available: {', '.join(known)}); "
        "the hccl and nccl backends come with the hardware package: pip install -e hw"
    )


def installed_backends() -> list[str]:
    """The names of every installed backend (their entry points), sorted."""
    return sorted({entry.name for entry in entry_points(group=ENTRY_POINT_GROUP)})


def backend_for_device_kind(kind: str) -> CollectiveBackend | None:
    """The installed backend that declares ``kind`` its device kind, if any."""
    for name in installed_backends():
        backend = get_collective_backend(name)
        if backend.device_kind == kind:
            return backend
    return None
