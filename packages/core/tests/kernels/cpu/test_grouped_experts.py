"""The grouped AVX2 expert kernel: one call per projection for every active expert, against
float64, and the MoE block on it against the per-expert torch path; offsets it cannot
trust are refused. Absent (skipped) where the AVX2 kernel does not serve float32.

Tolerance, per element: a float32 dot product over K terms is within gamma_K times the sum
of |a_k b_k| of exact (Higham, sec. 3.1) in any order. Through the block: the gate/up
outputs within g1 = gamma_H (|x| @ |w13|^T); SiLU(g) u moves by at most 1.1 |u| dg +
|silu(g)| du (|silu'| <= 1.1) plus its own roundings (8 u32, relative); the down projection
adds gamma_I (|h| @ |w2|^T) and carries |dh| @ |w2|^T; the routing weights and the sum
over the k choices add two roundings of the result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.collectives import SingleRankGroup
from tandem.core.kernels.cpu.avx2_linear import Avx2Linear, pack_experts
from tandem.core.kernels.cpu.packed_linear import native_kernel, packing_enabled
from tandem.core.kernels.reference.fused_moe import fused_moe
from tandem.core.layers.fused_moe import FusedMoeExperts, pack_expert_weights

U = 2.0**-24
CPU = torch.device("cpu")


def _gamma(k: int) -> float:
    return k * U / (1 - k * U)


def _kernel() -> Avx2Linear:
    kernel = native_kernel(torch.float32) if packing_enabled(torch.float32) else None
    if not isinstance(kernel, Avx2Linear):
        pytest.skip("the AVX2 kernel does not serve float32 on this CPU or ISA level")
    return kernel


@pytest.mark.parametrize("rows_per_expert", [[0, 3, 0, 11, 1, 0, 6, 48], [700, 0, 5, 0]])
def test_one_call_multiplies_each_experts_rows_by_its_weight(rows_per_expert: list[int]) -> None:
    kernel = _kernel()
    experts, n, k = len(rows_per_expert), 192, 300
    g = torch.Generator().manual_seed(len(rows_per_expert))
    weight = torch.randn(experts, n, k, generator=g) * 0.05
    packed = pack_experts(weight)
    assert packed is not None and packed.panel in (16, 64)
    offsets = torch.tensor([0, *torch.tensor(rows_per_expert).cumsum(0).tolist()])
    x = torch.randn(int(offsets[-1]), k, generator=g)
    got = kernel.grouped_matmul(x, packed, offsets)
    for e in range(experts):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        rows = x[lo:hi].double()
        exact = rows @ weight[e].double().T
        bound = _gamma(k) * (rows.abs() @ weight[e].double().abs().T)
        assert bool(((got[lo:hi].double() - exact).abs() <= bound).all()), e


def test_offsets_it_cannot_trust_are_refused() -> None:
    kernel = _kernel()
    packed = pack_experts(torch.randn(2, 64, 32))
    assert packed is not None
    x = torch.randn(5, 32)
    for bad in ([0, 4, 6], [0, 3, 2], [-1, 2, 5]):  # past x, backwards, before x
        with pytest.raises(ValueError, match="refused"):
            kernel.grouped_matmul(x, packed, torch.tensor(bad))
    with pytest.raises(ValueError, match="entries"):
        kernel.grouped_matmul(x, packed, torch.tensor([0, 5]))


def test_the_block_on_the_grouped_kernel_matches_the_per_expert_path() -> None:
    kernel = _kernel()
    hidden, experts, inter, top_k, tokens = 128, 8, 96, 2, 61
    g = torch.Generator().manual_seed(3)
    block = FusedMoeExperts(experts, hidden, inter, "silu", SingleRankGroup())
    block.w13.data = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1
    block.w2.data = torch.randn(experts, hidden, inter, generator=g) * 0.1
    w13, w2 = block.w13.data.clone(), block.w2.data.clone()
    x = torch.randn(tokens, hidden, generator=g)
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)

    assert pack_expert_weights(block, CPU, torch.float32) == 1
    assert block._grouped is not None and block._grouped[0] is kernel
    got = block(x, weights, ids)
    want = fused_moe(x, w13, w2, weights, ids, "silu")

    # The bound of the module docstring, from float64 intermediates.
    xd, w13d, w2d = x.double(), w13.double(), w2.double()
    bound = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for c in range(top_k):
            e = int(ids[t, c])
            gu = w13d[e] @ xd[t]
            d_gu = 2 * _gamma(hidden) * (w13d[e].abs() @ xd[t].abs())
            gate, up = gu[:inter], gu[inter:]
            h = F.silu(gate) * up
            d_h = 1.1 * up.abs() * d_gu[:inter] + F.silu(gate).abs() * d_gu[inter:]
            d_h = d_h + 8 * U * h.abs()
            y = w2d[e] @ h
            d_y = 2 * _gamma(inter) * (w2d[e].abs() @ h.abs()) + w2d[e].abs() @ d_h
            bound[t] += float(weights[t, c]) * (d_y + 2 * U * y.abs())
    assert bool(((got.double() - want.double()).abs() <= bound + 1e-12).all())


def test_other_dtypes_and_shapes_stay_on_the_torch_path() -> None:
    assert pack_experts(torch.randn(2, 40, 32)) is None  # N off the 16-column panels
    assert pack_experts(torch.randn(2, 64, 32).bfloat16()) is None
    block = FusedMoeExperts(4, 32, 16, "silu", SingleRankGroup())
    assert pack_expert_weights(block, CPU, torch.bfloat16) == 0
    assert block._grouped is None
