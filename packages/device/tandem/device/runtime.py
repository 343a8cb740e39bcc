"""The device runtime interface and the registry that picks an implementation by kind.

Implementations for other kinds register themselves by name: the simulator's fake through
``register_runtime``, the hardware package's npu and cuda runtimes through the
``tandem.device_runtimes`` entry-point group. Nothing here imports them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, Protocol, TypeVar

from tandem.device.cpu import CpuRuntime
from tandem.device.device import Device
from tandem.device.memory_info import MemoryInfo
from tandem.device.scratch_allocator import Event
from tandem.device.sync import Promise

T = TypeVar("T")


class DeviceRuntime(Protocol):
    """What a worker needs from a device: binding, streams, memory figures."""

    kind: str
    # The kernel families this runtime launches, most preferred first ("cpu": the C++ built
    # for the host; "torch_npu": torch_npu's fused ops; "triton"); a kernel none of them
    # serves runs its torch reference.
    kernel_families: tuple[str, ...]

    def bind(self, device: Device) -> None:
        """Make ``device`` current for the calling thread through the framework's setter."""

    def torch_device(self, device: Device) -> Any:
        """The torch device tensors of ``device`` live on."""

    def current_device(self) -> Device | None:
        """The device bound to the calling thread, or None."""

    def current_stream(self) -> Any:
        """The calling thread's current stream on its bound device."""

    def synchronize(self) -> None:
        """Wait until the bound device has finished all queued work."""

    def memory_info(self, device: Device) -> MemoryInfo:
        """Total and free memory of ``device`` in bytes."""

    def device_count(self) -> int:
        """How many devices of this kind the process can see."""

    def load_kernel(
        self, name: str, impl: Callable[..., Any], device: Device
    ) -> Callable[..., Any]:
        """Register kernel ``name`` on ``device`` and return what to call. Called once per
        (kernel, device, variant) by the kernel registry."""

    def new_stream(self, name: str) -> DeviceStream:
        """A stream of its own on the calling thread's device."""
        ...


class DeviceStream(Protocol):
    """Work submitted runs after everything submitted before it (on CPU an ordered executor
    with a thread of its own; on an accelerator a device stream)."""

    def submit(self, fn: Callable[[], T]) -> Promise[T]: ...

    def record_event(self) -> Event: ...

    def is_alive(self) -> bool: ...

    def stop(self) -> None: ...


RuntimeFactory = Callable[[], DeviceRuntime]

ENTRY_POINT_GROUP = "tandem.device_runtimes"

_factories: dict[str, RuntimeFactory] = {}
_instances: dict[str, DeviceRuntime] = {}
# Guards the two tables above: registration and first use may come from several workers.
_lock = threading.Lock()


def register_runtime(kind: str, factory: RuntimeFactory) -> None:
    """Make ``get_runtime(kind)`` build its runtime with ``factory`` (first registration wins)."""
    with _lock:
        _factories.setdefault(kind, factory)


def known_device_kinds() -> list[str]:
    """Every kind a runtime is registered or installed for, sorted."""
    with _lock:
        kinds = set(_factories)
    kinds.update(entry.name for entry in entry_points(group=ENTRY_POINT_GROUP))
    return sorted(kinds)


def get_runtime(kind: str) -> DeviceRuntime:
    """The one runtime instance for ``kind``, created on first use."""
    with _lock:
        runtime = _instances.get(kind)
        if runtime is not None:
            return runtime
        factory = _factories.get(kind)
        if factory is None:
            for entry in entry_points(group=ENTRY_POINT_GROUP, name=kind):
                factory = entry.load()
                break
        if factory is None:
            known = ", ".join(sorted(_factories)) or "none"
            raise RuntimeError(
                f"no device runtime is registered for {kind!r} (registered: {known}); "
                "install the hardware package (pip install -e hw) for this device kind, or use "
                "--devices cpu:0"
            )
        runtime = factory()
        _instances[kind] = runtime
        return runtime


# The CPU runtime ships with this package: registered here, at import, so it is always found.
register_runtime("cpu", CpuRuntime)
