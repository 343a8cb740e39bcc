"""A module's handle on one kernel, resolved through the process-global kernel registry on
first use by each worker, then called directly.

Device runtimes that compile or register kernels (NPU) get exactly one registration per
(kernel, device, dtype), however many workers reach their first forward at the same moment.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


def library_choice(library: Callable[[], Any], name: str) -> NativeChoice[Any]:
    """The kernel ``name`` of a native CPU library (``library()``: the loaded library, or
    None where it cannot be had) for each dtype its ``handles`` accepts."""

    def choose(dtype: torch.dtype) -> Callable[..., Any] | None:
        kernels = library()
        if kernels is None or not kernels.handles(dtype):
            return None
        fn: Callable[..., Any] = getattr(kernels, name)
        return fn

    return choose


# The kernel families, by the names runtimes list in ``kernel_families``.
CPU, TORCH_NPU, TRITON = "cpu", "torch_npu", "triton"


class KernelHandle(Generic[R]):
    """One module's handle on a kernel. A module belongs to one worker, so the handle it
    resolved on its worker's device can be kept.

    ``impl`` is the torch implementation (the reference, and what runs wherever no family
    has its own); ``native`` names a fused CPU kernel to use instead where one is built for
    the dtype, ``npu`` torch_npu's fused op (Ascend), ``triton`` the Triton kernel for the
    accelerators (CUDA, and NPU through triton-ascend) where Triton is usable. Which of them
    may run is the device runtime's to say (``DeviceRuntime.kernel_families``, most preferred
    first), not the tensors': the simulator's NPU keeps its tensors in host memory and still
    launches what an NPU would. ``variant`` joins the registry key when the choice depends
    on more than the dtype (a head size): other shapes on one device must not inherit it."""

    def __init__(
        self,
        name: str,
        impl: Callable[..., R],
        native: NativeChoice[R] | None = None,
        variant: str = "",
        triton: NativeChoice[R] | None = None,
        npu: NativeChoice[R] | None = None,
    ) -> None:
        self.name = name
        self.impl = impl
        self.variant = variant
        self.families: dict[str, NativeChoice[R]] = {
            family: choice
            for family, choice in ((CPU, native), (TORCH_NPU, npu), (TRITON, triton))
            if choice is not None
        }
        self._resolved: tuple[torch.dtype, Callable[..., R]] | None = None

    def __call__(self, x: torch.Tensor, *args: Any) -> R:
        resolved = self._resolved
        if resolved is None or resolved[0] is not x.dtype:
            resolved = (x.dtype, self._resolve(x))
            self._resolved = resolved
        return resolved[1](x, *args)

    def choose(self, families: Sequence[str], dtype: torch.dtype) -> Callable[..., R]:
        """The first of ``families`` with a kernel for ``dtype``, else the reference."""
        for family in families:
            choice = self.families.get(family)
            chosen = choice(dtype) if choice is not None else None
            if chosen is not None:
                return chosen
        return self.impl

    def _resolve(self, x: torch.Tensor) -> Callable[..., R]:
        context = bound_context()
        runtime = context.runtime if context else get_runtime(x.device.type)
        registry = context.registry if context else process_kernel_registry()
        device = runtime.current_device() or Device(x.device.type, x.device.index or 0)
        detail = f"{x.dtype},{self.variant}" if self.variant else str(x.dtype)
        key = KernelKey(self.name, device, detail)
        impl = self.choose(runtime.kernel_families, x.dtype)
        handle: Callable[..., R] = registry.get(
            key, lambda: runtime.load_kernel(self.name, impl, device)
        )
        return handle
