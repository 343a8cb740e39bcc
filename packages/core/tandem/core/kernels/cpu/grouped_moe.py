"""The routed experts on the AVX2 kernel: each projection one grouped call over every active
expert (``Avx2Linear.grouped_matmul``). The per-expert offsets stay a tensor the kernel
reads, so routing needs no host sync, and the (expert, panel) pairs are the work the cores
share, where per-expert GEMMs of a dozen decode rows each left them mostly waiting on
dispatch."""

from __future__ import annotations

import torch

from tandem.core.kernels.cpu.avx2_linear import Avx2Linear, PackedExperts
from tandem.core.kernels.handle import KernelHandle


def grouped_fused_moe(
    x: torch.Tensor,
    kernel: Avx2Linear,
    w13: PackedExperts,
    w2: PackedExperts,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act: KernelHandle[torch.Tensor],
) -> torch.Tensor:
    """``fused_moe`` with each projection one grouped kernel call over every expert."""
    num_choices = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # stable: a token's experts stay in id order
    token = order // num_choices
    offsets = torch.zeros(w13.experts + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(flat, minlength=w13.experts), 0, out=offsets[1:])
    rows = x.index_select(0, token)
    hidden = act(kernel.grouped_matmul(rows, w13, offsets))
    out = kernel.grouped_matmul(hidden, w2, offsets)
    out.mul_(topk_weights.reshape(-1)[order].unsqueeze(1).to(out.dtype))
    return torch.zeros_like(x).index_add_(0, token, out)
