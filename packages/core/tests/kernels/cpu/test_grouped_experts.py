"""The grouped expert kernels (AVX2 float32, AVX-512 float32, AVX512-BF16, AMX bfloat16):
one call per projection for every active expert, against float64, and the MoE block on them
against the per-expert torch path (float32) or float64 (bfloat16); offsets they cannot trust
are refused. The routing library's one-call block, which calls their entry points, against the
calls it replaces, bit for bit, and its workspace against the C source's count. Each is
skipped where this CPU or ISA level does not serve its dtype with it, except the AMX kernel's
test build on emulated tiles ("amx-emulated"), which every CPU runs where the kernel is called
directly, and the AVX-512 kernel built with each CPU vendor's weight streaming
("avx512-float32-nta", "avx512-float32-l2", and bfloat16's where the CPU has AVX512-BF16),
which every AVX-512 CPU runs.

Tolerance, per element: a float32 dot product over K terms is within gamma_K times the sum
of |a_k b_k| of exact (Higham, sec. 3.1) in any order. Through the block: the gate/up
outputs within g1 = gamma_H (|x| @ |w13|^T); SiLU(g) u moves by at most 1.1 |u| dg +
|silu(g)| du (|silu'| <= 1.1) plus its own roundings (8 u32, relative); the down projection
adds gamma_I (|h| @ |w2|^T) and carries |dh| @ |w2|^T; the routing weights and the sum
over the k choices add two roundings of the result.

bfloat16 (unit roundoff u_b = 2^-8): the products of two bfloat16 numbers are exact in
float32 and summed in float32 (gamma_K of float32, as above), then rounded to bfloat16 once:
|out - exact| <= u_b |exact| + (1 + u_b) gamma_K sum |a_k b_k|. Through the block, each
bfloat16 rounding is one more u_b of its value: gate/up (one), the activation (up to two:
SiLU, then the product), the down projection (one), the routing weight's product (one) and
the sum over the choices (one, of the sum); second-order terms (u_b^2 relative) are covered
by a factor (1 + 8 u_b) on the whole bound."""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache

import pytest
import torch
import torch.nn.functional as F

from tandem.collectives import SingleRankGroup
from tandem.core.kernels import handles
from tandem.core.kernels.cpu import startup
from tandem.core.kernels.cpu.amx_linear import AmxLinear, load_amx_linear
from tandem.core.kernels.cpu.avx2_linear import Avx2Linear, pack_experts
from tandem.core.kernels.cpu.avx512_linear import (
    Avx512Kernels,
    Avx512Linear,
    WeightStreaming,
    avx512_linear,
    load_avx512_linear,
)
from tandem.core.kernels.cpu.elementwise import native_elementwise
from tandem.core.kernels.cpu.grouped_moe import grouped_fused_moe
from tandem.core.kernels.cpu.moe_routing import (
    NativeMoeRouting,
    native_moe_routing,
    workspace_bytes,
)
from tandem.core.kernels.cpu.packed_experts import GroupedExpertKernel, PackedExperts
from tandem.core.kernels.cpu.packed_linear import native_kernel, packing_enabled
from tandem.core.kernels.reference.fused_moe import fused_moe
from tandem.core.layers import fused_moe as fused_moe_layer
from tandem.core.layers.fused_moe import FusedMoeExperts, pack_expert_weights
from tandem.device.cpu import collapse_to_huge_pages

U = 2.0**-24
U_BF16 = 2.0**-8
CPU = torch.device("cpu")
# The kernels the engine may pack experts for.
ENGINE_KERNELS = ["avx2-float32", "avx512-float32", "avx512-bfloat16", "amx-bfloat16"]
# And the test builds: emulated AMX, and the AVX-512 kernel with each vendor's weight
# streaming (one of them this CPU's), float32 and, where the CPU has AVX512-BF16, bfloat16.
STREAMED = [f"avx512-{d}-{s.value}" for d in ("float32", "bfloat16") for s in WeightStreaming]
KERNELS = [*ENGINE_KERNELS, "amx-emulated", *STREAMED]


def _gamma(k: int) -> float:
    return k * U / (1 - k * U)


@cache
def _emulated_amx() -> AmxLinear | None:
    return load_amx_linear(emulated=True)


@cache
def _streamed_avx512(streaming: WeightStreaming) -> Avx512Kernels | None:
    return load_avx512_linear(streaming=streaming)


def _kernel(which: str = "avx2-float32") -> GroupedExpertKernel:
    """The grouped kernel ``which`` names, where the engine would pack experts for it (the
    emulated AMX build: wherever a compiler is)."""
    if which == "amx-emulated":
        emulated = _emulated_amx()
        if emulated is None:
            pytest.skip("no C++ compiler")
        return emulated
    if which in STREAMED:
        _, dtype_name, streaming = which.split("-")
        kernels = _streamed_avx512(WeightStreaming(streaming))
        streamed: Avx512Linear | None = None if kernels is None else getattr(kernels, dtype_name)
        if streamed is None:
            pytest.skip(f"no AVX-512 {dtype_name} kernel on this CPU or ISA level")
        return streamed
    isa, dtype_name = which.split("-")
    dtype = getattr(torch, dtype_name)
    kernel = native_kernel(dtype) if packing_enabled(dtype) else None
    if isa == "avx2" and not isinstance(kernel, Avx2Linear):
        pytest.skip("the AVX2 kernel does not serve float32 on this CPU or ISA level")
    if isa == "avx512":
        kernels = avx512_linear()
        chosen: Avx512Linear | None = None if kernels is None else getattr(kernels, dtype_name)
        if chosen is None or kernel is not chosen:
            pytest.skip(f"the AVX-512 kernel does not serve {dtype_name} on this CPU or ISA level")
        return chosen
    if isa == "amx":
        if not isinstance(kernel, AmxLinear):
            pytest.skip("the AMX kernel does not serve bfloat16 on this CPU or ISA level")
        return kernel
    assert isinstance(kernel, Avx2Linear)
    return kernel


def _k(kernel: GroupedExpertKernel, k: int) -> int:
    """``k`` as the kernel takes it: the AMX kernel's K a multiple of its 32-deep steps."""
    return -(-k // 32) * 32 if isinstance(kernel, AmxLinear) else k


@pytest.mark.parametrize("which", KERNELS)
@pytest.mark.parametrize("rows_per_expert", [[0, 3, 0, 11, 1, 0, 6, 48], [700, 0, 5, 0]])
# 300: one K chunk per panel; 1000: K cut into equal chunks (three of float32 steps, two of
# bfloat16 pairs), each chunk prefetching the next.
@pytest.mark.parametrize("k", [300, 1000])
def test_one_call_multiplies_each_experts_rows_by_its_weight(
    rows_per_expert: list[int], k: int, which: str
) -> None:
    kernel = _kernel(which)
    k = _k(kernel, k)
    experts, n = len(rows_per_expert), 192
    g = torch.Generator().manual_seed(len(rows_per_expert))
    weight = (torch.randn(experts, n, k, generator=g) * 0.05).to(kernel.dtype)
    packed = kernel.pack_experts(weight)
    assert packed is not None and packed.panel in (16, 32, 64)
    offsets = torch.tensor([0, *torch.tensor(rows_per_expert).cumsum(0).tolist()])
    x = torch.randn(int(offsets[-1]), k, generator=g).to(kernel.dtype)
    _assert_each_experts_product(kernel, x, weight, packed, offsets)


def _assert_each_experts_product(
    kernel: GroupedExpertKernel,
    x: torch.Tensor,
    weight: torch.Tensor,
    packed: PackedExperts,
    offsets: torch.Tensor,
) -> None:
    """The grouped product of ``x`` by ``weight`` [E, N, K] (``packed``: the kernel's
    packing of it) within the module docstring's bound of float64, expert by expert."""
    got = kernel.grouped_matmul(x, packed, offsets)
    rounding = U_BF16 if kernel.dtype is torch.bfloat16 else 0.0
    for e in range(weight.shape[0]):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        rows = x[lo:hi].double()
        exact = rows @ weight[e].double().T
        sums = (1 + rounding) * _gamma(x.shape[1]) * (rows.abs() @ weight[e].double().abs().T)
        bound = rounding * exact.abs() + sums
        assert bool(((got[lo:hi].double() - exact).abs() <= bound).all()), e


@pytest.mark.parametrize("which", ["amx-bfloat16", "amx-emulated"])
def test_amx_row_blocks_cover_every_chunk_of_units(which: str) -> None:
    """Experts of 64 rows or more go through the AMX kernel 32 rows at a time over equal
    chunks of units of up to 1 MiB of weight (amx_linear.cpp): at K = 1024 a 32-column
    unit is 64 KiB, so N = 640 (20 units) is two chunks of 10. Rows: 63 (unit by unit), 64
    (row blocks, exactly), 70 and 130 (a last block of 6 and of 2 rows: one x tile), 80 (a
    last block of 16) and 90 (of 26: two x tiles, the second partly zeros)."""
    kernel = _kernel(which)
    rows_per_expert = [70, 64, 63, 0, 130, 80, 90]
    g = torch.Generator().manual_seed(9)
    weight = (torch.randn(len(rows_per_expert), 640, 1024, generator=g) * 0.05).bfloat16()
    offsets = torch.tensor([0, *torch.tensor(rows_per_expert).cumsum(0).tolist()])
    x = torch.randn(int(offsets[-1]), 1024, generator=g).bfloat16()
    packed = kernel.pack_experts(weight)
    assert packed is not None
    _assert_each_experts_product(kernel, x, weight, packed, offsets)


@pytest.mark.parametrize("which", KERNELS)
def test_offsets_it_cannot_trust_are_refused(which: str) -> None:
    kernel = _kernel(which)
    packed = kernel.pack_experts(torch.randn(2, 64, 32).to(kernel.dtype))
    assert packed is not None
    x = torch.randn(5, 32).to(kernel.dtype)
    for bad in ([0, 4, 6], [0, 3, 2], [-1, 2, 5]):  # past x, backwards, before x
        with pytest.raises(ValueError, match="refused"):
            kernel.grouped_matmul(x, packed, torch.tensor(bad))
    with pytest.raises(ValueError, match="entries"):
        kernel.grouped_matmul(x, packed, torch.tensor([0, 5]))


@pytest.mark.parametrize("which", ["avx2-float32", "avx512-float32"])
def test_the_block_on_the_grouped_kernel_matches_the_per_expert_path(which: str) -> None:
    kernel = _kernel(which)
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


@pytest.mark.parametrize("which", ["avx512-bfloat16", "amx-bfloat16"])
def test_the_block_on_the_bfloat16_kernel_is_within_bfloat16_roundings_of_float64(
    which: str,
) -> None:
    kernel = _kernel(which)
    hidden, experts, inter, top_k, tokens = 128, 8, 96, 2, 61
    g = torch.Generator().manual_seed(5)
    block = FusedMoeExperts(experts, hidden, inter, "silu", SingleRankGroup())
    block.w13.data = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).bfloat16()
    block.w2.data = (torch.randn(experts, hidden, inter, generator=g) * 0.1).bfloat16()
    w13d, w2d = block.w13.data.double(), block.w2.data.double()
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    weights = weights.bfloat16()

    assert pack_expert_weights(block, CPU, torch.bfloat16) == 1
    assert block._grouped is not None and block._grouped[0] is kernel
    got = block(x, weights, ids)
    assert got.dtype is torch.bfloat16

    u, xe = U_BF16, x.double()
    exact = torch.zeros(tokens, hidden, dtype=torch.float64)
    bound = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for c in range(top_k):
            e, w = int(ids[t, c]), float(weights[t, c])
            gu = w13d[e] @ xe[t]
            d_gu = u * gu.abs() + 2 * _gamma(hidden) * (w13d[e].abs() @ xe[t].abs())
            gate, up = gu[:inter], gu[inter:]
            h = F.silu(gate) * up
            d_h = 1.1 * up.abs() * d_gu[:inter] + F.silu(gate).abs() * d_gu[inter:]
            d_h = d_h + 2 * u * h.abs()
            y = w2d[e] @ h
            d_y = u * y.abs() + 2 * _gamma(inter) * (w2d[e].abs() @ h.abs()) + w2d[e].abs() @ d_h
            exact[t] += w * y
            bound[t] += w * (d_y + u * y.abs())
    bound = (1 + 8 * u) * (bound + u * exact.abs())
    assert bool(((got.double() - exact).abs() <= bound).all())


def test_other_dtypes_and_shapes_stay_on_the_torch_path() -> None:
    assert pack_experts(torch.randn(2, 40, 32)) is None  # N off the 16-column panels
    assert pack_experts(torch.randn(2, 64, 32).bfloat16()) is None
    kernels = avx512_linear()
    if kernels is not None:
        assert kernels.float32.pack_experts(torch.randn(2, 40, 32)) is None  # off 64 columns
        assert kernels.float32.pack_experts(torch.randn(2, 64, 32).bfloat16()) is None
        if kernels.bfloat16 is not None:
            assert kernels.bfloat16.pack_experts(torch.randn(2, 64, 33).bfloat16()) is None
    amx = _emulated_amx()
    if amx is not None:
        assert amx.pack_experts(torch.randn(2, 48, 64).bfloat16()) is None  # off 32 columns
        assert amx.pack_experts(torch.randn(2, 64, 48).bfloat16()) is None  # K off 32
        assert amx.pack_experts(torch.randn(2, 64, 64)) is None
    block = FusedMoeExperts(4, 32, 16, "silu", SingleRankGroup())
    assert pack_expert_weights(block, CPU, torch.float16) == 0
    assert block._grouped is None


@pytest.mark.parametrize("which", ENGINE_KERNELS)
def test_the_kernel_report_names_the_grouped_kernel_for_the_experts(which: str) -> None:
    kernel = _kernel(which)
    role = f"MoE experts {which.split('-')[1]}"
    row = next(c for c in startup.build_report().choices if c.role == role)
    assert row.kernel == f"grouped {kernel.name} kernel"


@pytest.mark.parametrize("which", ENGINE_KERNELS)
def test_packed_experts_are_moved_to_huge_pages_whole_and_compute_the_same(
    which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernel = _kernel(which)
    hidden, experts, inter = 256, 4, 128
    g = torch.Generator().manual_seed(5)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).to(kernel.dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.1).to(kernel.dtype)
    x = torch.randn(40, hidden, generator=g).to(kernel.dtype)
    weights, ids = torch.topk(torch.softmax(torch.randn(40, experts, generator=g), -1), 2, -1)
    weights = weights.to(kernel.dtype)

    def block() -> FusedMoeExperts:
        made = FusedMoeExperts(experts, hidden, inter, "silu", SingleRankGroup())
        made.w13.data, made.w2.data = w13.clone(), w2.clone()
        return made

    monkeypatch.setattr(fused_moe_layer, "collapse_to_huge_pages", lambda ranges: 0)
    unmoved = block()
    assert pack_expert_weights(unmoved, CPU, kernel.dtype) == 1
    expected = unmoved(x, weights, ids)

    handed: list[tuple[int, int]] = []

    def collapse(ranges: Iterable[tuple[int, int]]) -> int:
        handed.extend(ranges)
        return collapse_to_huge_pages(handed)

    monkeypatch.setattr(fused_moe_layer, "collapse_to_huge_pages", collapse)
    moved = block()
    assert pack_expert_weights(moved, CPU, kernel.dtype) == 1
    # Both projections' packed buffers whole, and the same outputs, bit for bit.
    size = x.element_size() * experts * 2 * inter * hidden
    assert sorted(end - start for start, end in handed) == [size // 2, size]
    assert torch.equal(moved(x, weights, ids), expected)


@pytest.mark.parametrize("which", KERNELS)
@pytest.mark.parametrize("rows_per_expert", [[0, 3, 0, 11, 1, 0, 6, 48], [700, 0, 5, 0]])
@pytest.mark.parametrize("k", [300, 1000])
# 48: AVX2 packs N = 96 in 16-column panels (AVX-512 does not pack it).
@pytest.mark.parametrize("inter", [192, 48])
def test_silu_in_the_gate_up_epilogue_is_the_unfused_activation_bit_for_bit(
    rows_per_expert: list[int], k: int, which: str, inter: int
) -> None:
    """The fused call against the grouped product then the elementwise SiLU-and-mul kernel:
    the same sums rounded the same way, then the same operations (both libraries built
    without FMA contraction), so equal to the bit. 700 rows: several row groups of an
    expert (128 a group on AVX2, 512 on AVX-512, 128 a block on AMX)."""
    kernel = _kernel(which)
    k = _k(kernel, k)
    act = native_elementwise()
    if act is None:
        pytest.skip("no native elementwise kernels here")
    if inter == 48 and not isinstance(kernel, Avx2Linear):
        pytest.skip("only the AVX2 kernel packs 16-column panels")
    experts = len(rows_per_expert)
    g = torch.Generator().manual_seed(k)
    weight = (torch.randn(experts, 2 * inter, k, generator=g) * 0.05).to(kernel.dtype)
    packed = kernel.pack_experts(weight)
    assert packed is not None and kernel.gates_silu(packed)
    assert packed.panel == (16 if inter == 48 else 32 if isinstance(kernel, AmxLinear) else 64)
    offsets = torch.tensor([0, *torch.tensor(rows_per_expert).cumsum(0).tolist()])
    x = torch.randn(int(offsets[-1]), k, generator=g).to(kernel.dtype)
    got = kernel.grouped_silu_matmul(x, packed, offsets)
    assert got.shape == (x.shape[0], inter)
    assert torch.equal(got, act.silu_mul(kernel.grouped_matmul(x, packed, offsets)))


@pytest.mark.parametrize("which", ENGINE_KERNELS)
def test_the_block_takes_the_fused_silu_only_where_both_halves_fill_panels(
    which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernel = _kernel(which)
    fused: list[int] = []
    real = type(kernel).grouped_silu_matmul

    def spy(self: GroupedExpertKernel, x: torch.Tensor, *args: object) -> torch.Tensor:
        fused.append(x.shape[0])
        return real(self, x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(type(kernel), "grouped_silu_matmul", spy)
    g = torch.Generator().manual_seed(6)
    # 96 columns a half: off the 64-column panels (N = 192 is packed in them on AVX2 too),
    # three of AMX's 32-column units.
    cases = [(128, True), (96, isinstance(kernel, AmxLinear))]
    if isinstance(kernel, Avx2Linear):
        cases.append((48, True))  # N = 96 packed in 16-column panels: halves of three
    for inter, takes_it in cases:
        block = FusedMoeExperts(4, 64, inter, "silu", SingleRankGroup())
        block.w13.data = (torch.randn(4, 2 * inter, 64, generator=g) * 0.1).to(kernel.dtype)
        block.w2.data = (torch.randn(4, 64, inter, generator=g) * 0.1).to(kernel.dtype)
        assert pack_expert_weights(block, CPU, kernel.dtype) == 1
        x = torch.randn(9, 64, generator=g).to(kernel.dtype)
        weights, ids = torch.topk(torch.softmax(torch.randn(9, 4, generator=g), -1), 2, -1)
        fused.clear()
        block(x, weights.to(kernel.dtype), ids)
        assert fused == ([18] if takes_it else [])


def _routing() -> NativeMoeRouting:
    routing = native_moe_routing()
    if routing is None:
        pytest.skip("no native MoE routing library here (no compiler?)")
    return routing


@pytest.mark.parametrize("which", KERNELS)
# A decode step's row or two, the bench MoE's 48 rows of 8 experts, top 8 of 16 experts.
@pytest.mark.parametrize(("tokens", "top_k", "experts"), [(1, 1, 4), (48, 2, 8), (300, 8, 16)])
@pytest.mark.parametrize("normalize", [True, False])
def test_the_one_call_block_is_the_routed_calls_bit_for_bit(
    which: str, tokens: int, top_k: int, experts: int, normalize: bool
) -> None:
    """``NativeMoeRouting.block`` against the calls it replaces (top-k, sort, gather, both
    grouped GEMMs, the sum back), made one by one on the same kernel: the same operations on
    the same values in the same order, so equal to the bit."""
    kernel, routing = _kernel(which), _routing()
    hidden, inter = 256, 192 if isinstance(kernel, AmxLinear) else 128
    g = torch.Generator().manual_seed(tokens + experts)
    w13 = kernel.pack_experts((torch.randn(experts, 2 * inter, hidden, generator=g) * 0.05)
                              .to(kernel.dtype))  # fmt: skip
    w2 = kernel.pack_experts((torch.randn(experts, hidden, inter, generator=g) * 0.05)
                             .to(kernel.dtype))  # fmt: skip
    assert w13 is not None and w2 is not None and kernel.gates_silu(w13)
    x = torch.randn(tokens, hidden, generator=g).to(kernel.dtype)
    logits = torch.randn(tokens, experts, generator=g).to(kernel.dtype)

    weights, ids = routing.topk_softmax(logits, top_k, normalize)
    act = handles.gated_activation("silu")
    want = grouped_fused_moe(x, kernel, w13, w2, weights, ids, act, "silu")
    gate_up = (w13, kernel.grouped_entry(w13, silu=True))
    down = (w2, kernel.grouped_entry(w2, silu=False))
    got = routing.block(x, logits, top_k, normalize, gate_up, down)
    assert got.dtype is kernel.dtype and got.shape == (tokens, hidden)
    assert torch.equal(got, want)


@pytest.mark.parametrize("which", ENGINE_KERNELS)
def test_the_experts_module_routes_in_one_call_as_the_router_then_forward(which: str) -> None:
    """``FusedMoeExperts.routed`` (what ``SparseMoeBlock`` calls first) against the router's
    top-k then ``forward``; None, so that the block routes, where the module is unpacked."""
    kernel = _kernel(which)
    hidden, experts, inter, tokens = 128, 8, 128, 33
    g = torch.Generator().manual_seed(8)
    block = FusedMoeExperts(experts, hidden, inter, "silu", SingleRankGroup())
    block.w13.data = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).to(kernel.dtype)
    block.w2.data = (torch.randn(experts, hidden, inter, generator=g) * 0.1).to(kernel.dtype)
    x = torch.randn(tokens, hidden, generator=g).to(kernel.dtype)
    logits = torch.randn(tokens, experts, generator=g).to(kernel.dtype)
    assert block.routed(x, logits, 2, normalize=True) is None
    assert pack_expert_weights(block, CPU, kernel.dtype) == 1
    got = block.routed(x, logits, 2, normalize=True)
    assert got is not None
    assert torch.equal(got, block(x, *_routing().topk_softmax(logits, 2, normalize=True)))
    with pytest.raises(ValueError, match="top_k must be from 1"):
        block.routed(x, logits, experts + 1, normalize=True)

    # Where the gate/up call cannot fuse the activation, the block routes and calls forward.
    gelu = FusedMoeExperts(experts, hidden, inter, "gelu", SingleRankGroup())
    gelu.w13.data = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).to(kernel.dtype)
    gelu.w2.data = (torch.randn(experts, hidden, inter, generator=g) * 0.1).to(kernel.dtype)
    assert pack_expert_weights(gelu, CPU, kernel.dtype) == 1
    assert gelu.routed(x, logits, 2, normalize=True) is None
    # 96 a half: three of AMX's 32-column panels, off the 64-column ones (and AVX2 packs
    # N = 192 in 64-column panels too).
    odd = FusedMoeExperts(experts, hidden, 96, "silu", SingleRankGroup())
    odd.w13.data = (torch.randn(experts, 192, hidden, generator=g) * 0.1).to(kernel.dtype)
    odd.w2.data = (torch.randn(experts, hidden, 96, generator=g) * 0.1).to(kernel.dtype)
    assert pack_expert_weights(odd, CPU, kernel.dtype) == 1
    assert (odd.routed(x, logits, 2, normalize=True) is not None) == isinstance(kernel, AmxLinear)


def test_the_one_call_block_refuses_what_does_not_fit() -> None:
    kernel, routing = _kernel("amx-emulated"), _routing()
    w13 = kernel.pack_experts(torch.randn(4, 128, 64).bfloat16())
    w2 = kernel.pack_experts(torch.randn(4, 64, 64).bfloat16())
    assert w13 is not None and w2 is not None
    gate_up = (w13, kernel.grouped_entry(w13, silu=True))
    down = (w2, kernel.grouped_entry(w2, silu=False))
    x = torch.randn(5, 64).bfloat16()
    with pytest.raises(ValueError, match="rows and logits alike"):
        routing.block(x, torch.randn(5, 4), 2, True, gate_up, down)
    with pytest.raises(ValueError, match=r"logits \[5, 4\]"):
        routing.block(x, torch.randn(5, 3).bfloat16(), 2, True, gate_up, down)
    with pytest.raises(ValueError, match="do not fit its rows"):
        routing.block(x, torch.randn(5, 4).bfloat16(), 2, True, down, down)
    other = kernel.pack_experts(torch.randn(3, 64, 64).bfloat16())  # 3 experts, not 4
    assert other is not None
    with pytest.raises(ValueError, match="do not fit its rows"):
        routing.block(x, torch.randn(5, 4).bfloat16(), 2, True, gate_up, (other, down[1]))
    # Logits rows apart (a router padded to 32 outputs, its 4 true ones a view): as dense.
    padded = torch.randn(5, 32).bfloat16()
    got = routing.block(x, padded[:, :4], 2, True, gate_up, down)
    assert torch.equal(got, routing.block(x, padded[:, :4].contiguous(), 2, True, gate_up, down))
    # Columns apart: copied first.
    columns = torch.randn(5, 8).bfloat16()[:, ::2]
    got = routing.block(x, columns, 2, True, gate_up, down)
    assert torch.equal(got, routing.block(x, columns.contiguous(), 2, True, gate_up, down))


@pytest.mark.parametrize("which", ["amx-emulated", "avx2-float32", "avx512-float32"])
@pytest.mark.parametrize(("tokens", "top_k", "experts", "hidden"),
                         [(1, 1, 4, 64), (7, 3, 5, 128), (300, 8, 128, 192)])  # fmt: skip
def test_the_block_workspace_is_the_size_the_native_code_carves(
    which: str, tokens: int, top_k: int, experts: int, hidden: int
) -> None:
    """``workspace_bytes`` against the C source's own count: a byte less is refused (code
    4) before anything is written, the size itself runs."""
    kernel, routing = _kernel(which), _routing()
    inter, dtype = 64, kernel.dtype
    w13 = kernel.pack_experts(torch.zeros(experts, 2 * inter, hidden).to(dtype))
    w2 = kernel.pack_experts(torch.zeros(experts, hidden, inter).to(dtype))
    assert w13 is not None and w2 is not None
    up, down = kernel.grouped_entry(w13, silu=True), kernel.grouped_entry(w2, silu=False)
    size = workspace_bytes(tokens * top_k, experts, hidden, inter, dtype)
    workspace = torch.empty(size, dtype=torch.uint8)
    logits = torch.zeros(tokens, experts).to(dtype)
    x = torch.zeros(tokens, hidden).to(dtype)
    y = torch.full((tokens, hidden), float("nan")).to(dtype)

    def call(bytes_: int) -> int:
        return int(routing._block(
            y.data_ptr(), x.data_ptr(), tokens, hidden, hidden, hidden, logits.data_ptr(),
            experts, experts, top_k, 1, w13.packed.data_ptr(), up.address, up.panel,
            w2.packed.data_ptr(), down.address, down.panel, inter, workspace.data_ptr(),
            bytes_, 1 if dtype is torch.bfloat16 else 0, 1,
        ))  # fmt: skip

    assert call(size - 1) == 4
    assert bool(y.isnan().all())
    assert call(size) == 0
    assert bool((y == 0).all())
