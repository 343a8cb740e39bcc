"""A device's memory figures, as every runtime reports them.

Its own module because the runtime interface names it and the CPU runtime builds it, while
the interface's module registers the CPU runtime."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryInfo:
    total_bytes: int
    free_bytes: int
