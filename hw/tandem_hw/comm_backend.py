"""The ``hccl`` and ``nccl`` collective backends, found by name through entry points.

Single-process: one ``*CommInitAll`` for every local device, called from a thread that has the
first device bound through the framework; each worker then issues its collectives on its own
device's current stream. Multi-process: rank 0 makes the root info (unique id), torch's default
CPU group broadcasts it, every process calls ``*CommInitRootInfo`` / ``*CommInitRank``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import torch.distributed as dist

from tandem.collectives import CollectiveTimeout, ProcessGroup
from tandem.collectives.backends import CrossProcessGroup, LocalGroups
from tandem.device import Device, DeviceRuntime
from tandem.device.sync import Promise
from tandem.device.task_thread import TaskThread
from tandem_hw.accelerator_runtime import AcceleratorRuntime
from tandem_hw.comm_group import (
    BeforeCall,
    CommGroup,
    Communicators,
    DeviceBinder,
    StreamHandle,
)
from tandem_hw.comm_library import CommLibrary
from tandem_hw.ctypes_library import LibraryNotFound
from tandem_hw.hccl import HcclLibrary
from tandem_hw.launch_turns import LaunchTurns, shared_turns
from tandem_hw.nccl import NcclLibrary

logger = logging.getLogger(__name__)

# CPU tensors have no stream; the stand-in library only checks the handle is not null. One per
# device, so tests can see that each rank issued on its own.
STANDIN_STREAM_BASE = 0x5EED0000


def stream_handle_for(runtime: DeviceRuntime, device: Device) -> StreamHandle:
    """How a group finds the raw handle of the calling thread's current stream."""
    if isinstance(runtime, AcceleratorRuntime):
        return runtime.stream_handle
    handle = STANDIN_STREAM_BASE + device.index
    return lambda: handle


def thread_binder(runtime: DeviceRuntime, library: CommLibrary) -> DeviceBinder:
    """How the backend's own threads (creating and destroying communicators) take a device:
    the runtime's bind, which on a card is the framework's set_device (torch.npu.set_device
    reaches aclrtSetDevice, whose per-thread device HCCL reads back). Host devices under the
    CPU stand-in have no such runtime beneath the CPU one, so the stand-in's own
    aclrtSetDevice follows the runtime's bind, as torch_npu's follows torch's."""
    set_device = None if isinstance(runtime, AcceleratorRuntime) else library.host_set_device
    if set_device is None:
        return runtime.bind

    def bind(device: Device) -> None:
        runtime.bind(device)
        set_device(device.index)

    return bind


def thread_device_mirror(runtime: DeviceRuntime, library: CommLibrary) -> BeforeCall | None:
    """On host devices under the CPU stand-in: before each collective, hand the stand-in's ACL
    the device the runtime bound on the calling thread, as a card's ACL holds the device
    torch.npu.set_device bound there. A thread the runtime never bound hands over nothing,
    and the stand-in refuses its call as HCCL refuses one from a thread without a device.
    None for a real library, whose runtime the framework's set_device reaches itself."""
    set_device = None if isinstance(runtime, AcceleratorRuntime) else library.host_set_device
    if set_device is None:
        return None

    def mirror() -> None:
        device = runtime.current_device()
        if device is not None:
            set_device(device.index)

    return mirror


class LibraryBackend:
    name: str
    # The device kind the real library drives.
    device_kind: str
    torch_dist_backend: str

    def __init__(self, load: Callable[[], CommLibrary]) -> None:
        self._load = load
        self._library: CommLibrary | None = None
        self._lock = threading.Lock()

    def library(self) -> CommLibrary:
        with self._lock:
            if self._library is None:
                self._library = self._load()
            return self._library

    def check(self, device_kind: str) -> None:
        try:
            library = self.library()
        except LibraryNotFound as exc:
            raise ValueError(f"{self.name} collectives: {exc}") from None
        if device_kind == self.device_kind:
            return
        if device_kind == "cpu" and library.is_standin:
            logger.warning(
                "%s collectives on cpu devices through the CPU stand-in library %s",
                self.name,
                library.path,
            )
            return
        raise ValueError(
            f"{self.name} collectives serve {self.device_kind} devices, not {device_kind} "
            f"(only the CPU stand-in library takes host memory); use --local-collectives auto "
            "and --process-collectives auto to pick the backend from the device kind"
        )

    def local_groups(
        self, devices: Sequence[Device], runtime: DeviceRuntime, timeout_s: float
    ) -> LocalGroups:
        library = self.library()
        bind = thread_binder(runtime, library)

        def init() -> list[int]:
            bind(devices[0])
            return library.init_all([d.index for d in devices])

        # A thread of its own, so the caller's thread keeps its device binding.
        thread = TaskThread(f"tandem-{self.name}-init")
        created = thread.submit(init)
        try:
            comms = created.result(timeout=timeout_s)
        except TimeoutError:
            self._destroy_when_created(created, devices, bind, timeout_s)
            raise CollectiveTimeout(
                f"{self.name} communicator creation took over {timeout_s} s; the native call "
                "cannot be interrupted and keeps running on its own thread until the library "
                "gives up (HCCL_CONNECT_TIMEOUT for HCCL); whatever it creates is destroyed"
            ) from None
        finally:
            thread.stop(timeout=0)
        turns = shared_turns([str(d) for d in devices])
        communicators = Communicators(
            library,
            comms,
            devices,
            bind,
            turns,
            timeout_s,
            label=f"one of {len(devices)} made at once",
        )
        mirror = thread_device_mirror(runtime, library)
        groups: list[ProcessGroup] = [
            CommGroup(
                library,
                comm,
                rank,
                len(devices),
                stream_handle_for(runtime, device),
                communicators,
                runtime.torch_device(device),
                mirror,
            )
            for rank, (comm, device) in enumerate(zip(comms, devices, strict=True))
        ]
        logger.info("%s: one communicator set for %d local devices", self.name, len(devices))
        return LocalGroups(groups, communicators)

    def _destroy_when_created(
        self,
        created: Promise[list[int]],
        devices: Sequence[Device],
        bind: DeviceBinder,
        timeout_s: float,
    ) -> None:
        """After a timed-out creation: destroy the communicators if the call still returns."""
        library = self.library()

        def on_done(done: Promise[list[int]]) -> None:
            if done.exception() is not None:
                logger.warning(
                    "%s: the timed-out communicator creation failed late: %s",
                    self.name,
                    done.exception(),
                )
                return
            logger.warning(
                "%s: the timed-out communicator creation returned late; destroying its "
                "communicators",
                self.name,
            )
            turns = LaunchTurns([str(d) for d in devices])
            Communicators(library, done.result(), devices, bind, turns, timeout_s).close()

        created.add_done_callback(on_done)

    def process_group(
        self, device: Device, runtime: DeviceRuntime, rank: int, size: int, timeout_s: float
    ) -> CrossProcessGroup:
        library = self.library()
        bind = thread_binder(runtime, library)
        bind(device)
        box: list[object] = [library.unique_id() if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        unique_id = box[0]
        assert isinstance(unique_id, bytes)
        comm = library.init_rank(size, unique_id, rank)
        logger.info("%s: rank %d of %d joined through root info", self.name, rank, size)
        # One rank in this process: its turns are its own.
        communicators = Communicators(
            library,
            [comm],
            [device],
            bind,
            LaunchTurns([str(device)]),
            timeout_s,
            label=f"rank {rank} of {size} through root info",
        )
        group = CommGroup(
            library,
            comm,
            rank,
            size,
            stream_handle_for(runtime, device),
            communicators,
            runtime.torch_device(device),
            thread_device_mirror(runtime, library),
        )
        return CrossProcessGroup(group, communicators)


class HcclBackend(LibraryBackend):
    name = "hccl"
    device_kind = "npu"
    # Registered with torch.distributed by torch_npu.
    torch_dist_backend = "hccl"

    def __init__(self) -> None:
        super().__init__(HcclLibrary)


class NcclBackend(LibraryBackend):
    name = "nccl"
    device_kind = "cuda"
    torch_dist_backend = "nccl"

    def __init__(self) -> None:
        super().__init__(NcclLibrary)
