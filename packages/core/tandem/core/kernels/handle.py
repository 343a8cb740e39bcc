"""A module's handle on one kernel, resolved through the process-global kernel registry on
first use by each worker, then called directly.

Device runtimes that compile or register kernels (NPU) get exactly one registration per
(kernel, device, dtype), however many workers reach their first forward at the same moment.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from tandem.device import (
    Device,
    KernelKey,
    bound_context,
    get_runtime,
    process_kernel_registry,
)

R = TypeVar("R")
KernelFn = Callable[..., torch.Tensor]
# A device family's kernel for a dtype; None where the family has none for it.
NativeChoice = Callable[[torch.dtype], Callable[..., R] | None]
# The devices Triton compiles for (NPU through triton-ascend).
TRITON_DEVICES = frozenset({"cuda", "npu"})


class KernelHandle(Generic[R]):
    """One module's handle on a kernel. A module belongs to one worker, so the handle it
    resolved on its worker's device can be kept.

    ``impl`` is the torch implementation (the reference, and what runs wherever no family
    has its own); ``native`` names a fused CPU kernel to use instead where one is built for
    the dtype, ``triton`` the Triton kernel for the accelerators (CUDA, and NPU through
    triton-ascend) where Triton is usable. ``variant`` joins the registry key when the
    choice depends on more than the dtype (a head size): other shapes on one device must
    not inherit it."""

    def __init__(
        self,
        name: str,
        impl: Callable[..., R],
        native: NativeChoice[R] | None = None,
        variant: str = "",
        triton: NativeChoice[R] | None = None,
    ) -> None:
        self.name = name
        self.impl = impl
        self.native = native
        self.triton = triton
        self.variant = variant
        self._resolved: tuple[torch.dtype, Callable[..., R]] | None = None

    def __call__(self, x: torch.Tensor, *args: Any) -> R:
        resolved = self._resolved
        if resolved is None or resolved[0] is not x.dtype:
            resolved = (x.dtype, self._resolve(x))
            self._resolved = resolved
        return resolved[1](x, *args)

    def choose(self, device_type: str, dtype: torch.dtype) -> Callable[..., R]:
        family = self.native if device_type == "cpu" else None
        if device_type in TRITON_DEVICES:
            family = self.triton
        chosen = family(dtype) if family is not None else None
        return chosen if chosen is not None else self.impl

    def _resolve(self, x: torch.Tensor) -> Callable[..., R]:
        context = bound_context()
        runtime = context.runtime if context else get_runtime(x.device.type)
        registry = context.registry if context else process_kernel_registry()
        device = runtime.current_device() or Device(x.device.type, x.device.index or 0)
        detail = f"{x.dtype},{self.variant}" if self.variant else str(x.dtype)
        key = KernelKey(self.name, device, detail)
        impl = self.choose(x.device.type, x.dtype)
        handle: Callable[..., R] = registry.get(
            key, lambda: runtime.load_kernel(self.name, impl, device)
        )
        return handle
