"""Gated activations over a fused [gate | up] projection, as registry-resolved kernels."""

from __future__ import annotations

from tandem.core.layers.kernels import GATED_ACTIVATIONS, KernelHandle


def gated_activation_kernel(name: str) -> KernelHandle:
    impl = GATED_ACTIVATIONS.get(name)
    if impl is None:
        supported = ", ".join(sorted(GATED_ACTIVATIONS))
        raise ValueError(f"unsupported activation {name!r}; supported: {supported}")
    return KernelHandle(f"gated_{name}", impl)
