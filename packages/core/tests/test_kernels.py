"""The models' kernels resolve through the process-global kernel registry."""

from __future__ import annotations

import torch

from tandem.core.layers.norm import RMSNorm
from tandem.device import Device, KernelKey, process_kernel_registry


def test_the_models_kernels_go_through_the_process_registry() -> None:
    registry = process_kernel_registry()
    before = len(registry)
    norm = RMSNorm(8, eps=1e-6)
    x = torch.randn(3, 8, dtype=torch.float64)
    out = norm(x)
    assert out.shape == x.shape
    assert registry.lookup(KernelKey("rms_norm", Device("cpu", 0), "torch.float64")) is not None
    assert len(registry) >= before
