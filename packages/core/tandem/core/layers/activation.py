"""Gated activations over a fused [gate | up] projection, as registry-resolved kernels."""

from __future__ import annotations

import torch

from tandem.core.layers.kernels import GATED_ACTIVATIONS, KernelHandle, native_elementwise_kernel


def gated_activation_kernel(name: str) -> KernelHandle[torch.Tensor]:
    impl = GATED_ACTIVATIONS.get(name)
    if impl is None:
        supported = ", ".join(sorted(GATED_ACTIVATIONS))
        raise ValueError(f"unsupported activation {name!r}; supported: {supported}")
    # SiLU, the activation of every family served, has a fused CPU kernel.
    native = native_elementwise_kernel("silu_mul") if name == "silu" else None
    return KernelHandle(f"gated_{name}", impl, native)
