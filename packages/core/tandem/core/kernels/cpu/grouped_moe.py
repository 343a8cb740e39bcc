"""The routed experts on a grouped CPU kernel (AVX2 float32, AVX-512 float32, AVX512-BF16,
AMX bfloat16): each projection one grouped call over every active expert
(``packed_experts.py``). The per-expert offsets stay a tensor the kernel reads, so routing
needs no host sync, and the (expert, panel) pairs are the work the cores share, where
per-expert GEMMs of a dozen decode rows each left them mostly waiting on dispatch."""

from __future__ import annotations

import torch

from tandem.core.kernels.cpu.amx_linear import AmxLinear
from tandem.core.kernels.cpu.avx2_linear import Avx2Linear
from tandem.core.kernels.cpu.avx512_linear import Avx512Linear
from tandem.core.kernels.cpu.moe_routing import native_moe_routing
from tandem.core.kernels.cpu.packed_experts import (
    GroupedEntry,
    GroupedExpertKernel,
    PackedExperts,
)
from tandem.core.kernels.cpu.packed_linear import native_kernel, packing_enabled
from tandem.core.kernels.handle import KernelHandle
from tandem.core.kernels.reference.fused_moe import combine, sort_rows


def grouped_expert_kernel(dtype: torch.dtype) -> GroupedExpertKernel | None:
    """The grouped kernel of the one that serves dense layers of ``dtype`` on this CPU (AVX2
    float32, AVX-512 float32, AVX512-BF16, AMX bfloat16), or None."""
    if not packing_enabled(dtype):
        return None
    kernel = native_kernel(dtype)
    return kernel if isinstance(kernel, Avx2Linear | Avx512Linear | AmxLinear) else None


def grouped_fused_moe(
    x: torch.Tensor,
    kernel: GroupedExpertKernel,
    w13: PackedExperts,
    w2: PackedExperts,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act: KernelHandle[torch.Tensor],
    activation: str,
) -> torch.Tensor:
    """``fused_moe`` with each projection one grouped kernel call over every expert (SiLU
    in the gate/up call's epilogue where the weights fill the kernel's panels, and the sort
    and the sum back native where that library is built)."""

    def gate_up(rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        if activation == "silu" and kernel.gates_silu(w13):
            return kernel.grouped_silu_matmul(rows, w13, offsets)
        return act(kernel.grouped_matmul(rows, w13, offsets))

    routing = native_moe_routing()
    if routing is None or not routing.handles(x.dtype):
        order, token, offsets = sort_rows(topk_ids, w13.experts)
        hidden = gate_up(x.index_select(0, token), offsets)
        out = kernel.grouped_matmul(hidden, w2, offsets)
        return combine(x, out, order, token, topk_weights)
    offsets, token, slot = routing.route(topk_ids, w13.experts)
    hidden = gate_up(routing.gather(x, token), offsets)
    return routing.combine(kernel.grouped_matmul(hidden, w2, offsets), topk_weights, slot)


def one_call_entries(
    kernel: GroupedExpertKernel, w13: PackedExperts, w2: PackedExperts, activation: str
) -> tuple[tuple[PackedExperts, GroupedEntry], tuple[PackedExperts, GroupedEntry]] | None:
    """What ``grouped_routed_moe`` takes for these experts (each projection's weights and the
    kernel's entry point), looked up once at packing; None where the one call does not serve
    them (another activation, gate/up halves that are not whole panels)."""
    if activation != "silu" or not kernel.gates_silu(w13):
        return None
    return (w13, kernel.grouped_entry(w13, silu=True)), (w2, kernel.grouped_entry(w2, silu=False))


def grouped_routed_moe(
    x: torch.Tensor,
    logits: torch.Tensor,
    top_k: int,
    normalize: bool,
    gate_up: tuple[PackedExperts, GroupedEntry],
    down: tuple[PackedExperts, GroupedEntry],
) -> torch.Tensor | None:
    """The router's choice from ``logits`` and ``grouped_fused_moe`` of it in one native
    call (``NativeMoeRouting.block``), the same result bit for bit (``gate_up`` and ``down``:
    ``one_call_entries``); None where the routing library is not built for this dtype: the
    caller then routes and calls ``grouped_fused_moe``."""
    routing = native_moe_routing()
    if routing is None or not routing.handles(x.dtype):
        return None
    return routing.block(x, logits, top_k, normalize, gate_up, down)
