"""The models' elementwise kernels (RMSNorm, gated activations, rotary), resolved through the
process-global kernel registry on first use by each worker, then called directly.

On CPU a kernel is its torch implementation; device runtimes that compile or register kernels
(NPU) get exactly one registration per (kernel, device, dtype), however many workers reach
their first forward at the same moment.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch
import torch.nn.functional as F

from tandem.device import (
    Device,
    KernelKey,
    bound_context,
    get_runtime,
    process_kernel_registry,
)

R = TypeVar("R")
KernelFn = Callable[..., torch.Tensor]
# The native kernel a handle's name stands for on CPU, for a dtype; None where there is none.
NativeChoice = Callable[[torch.dtype], Callable[..., R] | None]


class KernelHandle(Generic[R]):
    """One module's handle on a kernel. A module belongs to one worker, so the handle it
    resolved on its worker's device can be kept.

    ``impl`` is the torch implementation (the reference, and what runs off CPU unless the
    device runtime registers its own); ``native`` names a fused CPU kernel to use instead
    where one is built for the dtype. ``variant`` joins the registry key when the choice
    depends on more than the dtype (a head size): other shapes on one device must not
    inherit it."""

    def __init__(
        self,
        name: str,
        impl: Callable[..., R],
        native: NativeChoice[R] | None = None,
        variant: str = "",
    ) -> None:
        self.name = name
        self.impl = impl
        self.native = native
        self.variant = variant
        self._resolved: tuple[torch.dtype, Callable[..., R]] | None = None

    def __call__(self, x: torch.Tensor, *args: Any) -> R:
        resolved = self._resolved
        if resolved is None or resolved[0] is not x.dtype:
            resolved = (x.dtype, self._resolve(x))
            self._resolved = resolved
        return resolved[1](x, *args)

    def choose(self, device_type: str, dtype: torch.dtype) -> Callable[..., R]:
        if device_type == "cpu" and self.native is not None:
            native = self.native(dtype)
            if native is not None:
                return native
        return self.impl

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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32, scale in the input dtype (as Llama and Qwen define it)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _gated(act: Callable[[torch.Tensor], torch.Tensor]) -> KernelFn:
    def kernel(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return act(gate) * up

    return kernel


GATED_ACTIVATIONS: dict[str, KernelFn] = {
    "silu": _gated(F.silu),
    "gelu": _gated(F.gelu),
    "gelu_pytorch_tanh": _gated(lambda t: F.gelu(t, approximate="tanh")),
}


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of ``x`` [T, H, D] with cos/sin [T, 1, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): a layer's residual add and the norm after it."""
    h = x + residual
    return rms_norm(h, weight, eps), h


def qk_norm_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q/k RMSNorm per head (Qwen3; skipped without weights), then rotary at ``positions``
    through the [max_position, D/2] tables."""
    if q_weight is not None and k_weight is not None:
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    return rotary(q, c, s), rotary(k, c, s)


def native_elementwise_kernel(name: str) -> NativeChoice[Any]:
    """The fused CPU kernel ``name`` of ``elementwise_cpu`` for a dtype, where it is built."""

    def choose(dtype: torch.dtype) -> Callable[..., Any] | None:
        from tandem.core.layers.elementwise_cpu import native_elementwise

        kernels = native_elementwise()
        if kernels is None or not kernels.handles(dtype):
            return None
        fn: Callable[..., Any] = getattr(kernels, name)
        return fn

    return choose
