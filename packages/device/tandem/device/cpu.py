"""The CPU device runtime: each CPU "device" is a worker identity with its own thread."""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

from tandem.device.device import Device
from tandem.device.runtime import MemoryInfo


def _meminfo_bytes(field: str) -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class CpuRuntime:
    kind = "cpu"

    def __init__(self) -> None:
        self._local = threading.local()

    def bind(self, device: Device) -> None:
        if device.kind != "cpu":
            raise ValueError(f"the CPU runtime cannot bind {device}")
        # torch's own setter, so code that asks torch for the current device stays consistent.
        torch.cpu.set_device(str(device.torch_device()))
        self._local.device = device

    def current_device(self) -> Device | None:
        device: Device | None = getattr(self._local, "device", None)
        return device

    def current_stream(self) -> Any:
        return torch.cpu.current_stream()

    def synchronize(self) -> None:
        torch.cpu.synchronize()

    def memory_info(self, device: Device) -> MemoryInfo:
        total = _meminfo_bytes("MemTotal")
        free = _meminfo_bytes("MemAvailable")
        if total is None or free is None:
            pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            return MemoryInfo(total_bytes=pages, free_bytes=pages)
        return MemoryInfo(total_bytes=total, free_bytes=free)

    def device_count(self) -> int:
        # CPU devices are logical: as many as the user names.
        return os.cpu_count() or 1
