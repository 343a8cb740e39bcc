"""Devices, streams and per-thread device binding.

A worker thread binds its device once through the framework's own setter (``bind``), so that
the framework's thread-local device cache and the thread's streams always agree.
"""

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
