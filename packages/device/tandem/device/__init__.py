"""Devices, streams and per-thread device binding.

A worker thread binds its device once through the framework's own setter (``bind``), so that
the framework's thread-local device cache and the thread's streams always agree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.device.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from tandem.device.context import BoundContext, bind_context, bound_context
    from tandem.device.device import Device
    from tandem.device.kernel_registry import KernelKey, KernelRegistry, process_kernel_registry
    from tandem.device.memory_info import MemoryInfo
    from tandem.device.parsing import parse_device, parse_devices
    from tandem.device.runtime import (
        DeviceRuntime,
        get_runtime,
        known_device_kinds,
        register_runtime,
    )

# Each public name and the module that defines it, imported on first use so that importing
# one submodule does not load the others (see tandem.device.lazy_exports).
_EXPORTS = {
    "BoundContext": "tandem.device.context",
    "Device": "tandem.device.device",
    "DeviceRuntime": "tandem.device.runtime",
    "KernelKey": "tandem.device.kernel_registry",
    "KernelRegistry": "tandem.device.kernel_registry",
    "MemoryInfo": "tandem.device.memory_info",
    "bind_context": "tandem.device.context",
    "bound_context": "tandem.device.context",
    "get_runtime": "tandem.device.runtime",
    "known_device_kinds": "tandem.device.runtime",
    "parse_device": "tandem.device.parsing",
    "parse_devices": "tandem.device.parsing",
    "process_kernel_registry": "tandem.device.kernel_registry",
    "register_runtime": "tandem.device.runtime",
}

__all__ = [
    "BoundContext",
    "Device",
    "DeviceRuntime",
    "KernelKey",
    "KernelRegistry",
    "MemoryInfo",
    "bind_context",
    "bound_context",
    "get_runtime",
    "known_device_kinds",
    "parse_device",
    "parse_devices",
    "process_kernel_registry",
    "register_runtime",
]

if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
