"""What a worker thread is bound to: its device runtime and the kernel registry its kernels
resolve through. Set once by the worker on its own thread (like the framework's current
device); code running on that thread (the model's kernels) reads it instead of looking the
runtime up by kind, so a simulator can hand a worker a fake runtime and its own registry."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from tandem.device.kernel_registry import KernelRegistry
from tandem.device.runtime import DeviceRuntime


@dataclass(frozen=True)
class BoundContext:
    runtime: DeviceRuntime
    registry: KernelRegistry[Any]


_local = threading.local()


def bind_context(context: BoundContext) -> None:
    _local.context = context


def bound_context() -> BoundContext | None:
    context: BoundContext | None = getattr(_local, "context", None)
    return context
