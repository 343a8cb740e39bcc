"""The models' elementwise kernels (RMSNorm, gated activations, rotary), resolved through the
process-global kernel registry on first use by each worker, then called directly.

On CPU a kernel is its torch implementation; device runtimes that compile or register kernels
(NPU) get exactly one registration per (kernel, device, dtype), however many workers reach
their first forward at the same moment.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tandem.device import (
    Device,
    KernelKey,
    bound_context,
    get_runtime,
    process_kernel_registry,
)

KernelFn = Callable[..., torch.Tensor]


class KernelHandle:
    """One module's handle on a kernel. A module belongs to one worker, so the handle it
    resolved on its worker's device can be kept."""

    def __init__(self, name: str, impl: KernelFn) -> None:
        self.name = name
        self.impl = impl
        self._resolved: tuple[torch.dtype, KernelFn] | None = None

    def __call__(self, x: torch.Tensor, *args: Any) -> torch.Tensor:
        resolved = self._resolved
        if resolved is None or resolved[0] is not x.dtype:
            resolved = (x.dtype, self._resolve(x))
            self._resolved = resolved
        return resolved[1](x, *args)

    def _resolve(self, x: torch.Tensor) -> KernelFn:
        context = bound_context()
        runtime = context.runtime if context else get_runtime(x.device.type)
        registry = context.registry if context else process_kernel_registry()
        device = runtime.current_device() or Device(x.device.type, x.device.index or 0)
        key = KernelKey(self.name, device, str(x.dtype))
        handle: KernelFn = registry.get(
            key, lambda: runtime.load_kernel(self.name, self.impl, device)
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
