"""The AVX2 kernel reads oneDNN's packed float32 weights and gives their products at every
batch size; it adopts only weights it was checked on, and packed layers route through it
only where it applies (float32, at most MAX_ROWS rows, no bias). Under
``TANDEM_CPU_ISA=portable`` (test_isa_levels.py) and on CPUs without AVX2 it is absent.

Tolerance: each output is a float32 dot product over K terms, an FMA chain; whatever the
order, its error is at most gamma_K = K u / (1 - K u) times the sum of |x_k w_k| (Higham,
Accuracy and Stability, sec. 3.1), u = 2^-24, checked per element against float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.collectives import SingleRankGroup
from tandem.core.kernels.cpu.avx2_linear import MAX_ROWS, Avx2Linear, avx2_linear
from tandem.core.kernels.cpu.elementwise import native_elementwise
from tandem.core.kernels.cpu.native_build import selected_isa
from tandem.core.kernels.cpu.packed_linear import (
    native_kernel,
    pack_linear_weights,
    packing_enabled,
)
from tandem.core.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)

CPU = torch.device("cpu")


def _kernel() -> Avx2Linear:
    kernel = avx2_linear()
    if kernel is None or not packing_enabled(torch.float32):
        pytest.skip("no AVX2 kernel on this CPU or at this ISA level (or no oneDNN packing)")
    if native_kernel(torch.float32) is not kernel:
        pytest.skip("float32 weights go to the AVX-512 kernel on this CPU")
    return kernel


def _packed(out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05
    return weight, torch.ops.mkldnn._reorder_linear_weight(weight, 128)


def _check(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    k = x.shape[1]
    exact = x.double() @ weight.double().T
    gamma = k * 2.0**-24 / (1 - k * 2.0**-24)
    bound = gamma * (x.double().abs() @ weight.double().abs().T)
    assert got.dtype is torch.float32 and got.shape == exact.shape
    assert bool(((got.double() - exact).abs() <= bound).all())


# K below one chunk, across the chunk edges (256 steps), and the bench model's down_proj;
# rows across the 6-row register blocks.
@pytest.mark.parametrize("shape", [(64, 32), (128, 300), (192, 1024), (1024, 2816)])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 41, 48, 127])
def test_products_match_float64(shape: tuple[int, int], rows: int) -> None:
    kernel = _kernel()
    out_features, in_features = shape
    weight, packed = _packed(out_features, in_features, seed=rows)
    adopted = kernel.adopt(packed, out_features, in_features)
    assert adopted is not None
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1))
    _check(adopted.matmul(x), x, weight)


@pytest.mark.parametrize("rows", [512, 515, 1100])
def test_prefill_size_batches_pass_in_row_groups(rows: int) -> None:
    # Serving hands batches past MAX_ROWS to oneDNN; the kernel's own row groups still serve
    # the grouped experts, and any caller that raises the limit.
    kernel = _kernel().taking_rows(2048)
    weight, packed = _packed(192, 1024, seed=rows)
    adopted = kernel.adopt(packed, 192, 1024)
    assert adopted is not None
    x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(2))
    _check(adopted.matmul(x), x, weight)


def test_weights_whose_k_onednn_padded_and_strided_batches() -> None:
    kernel = _kernel()
    for in_features in (1, 100, 1000):
        weight, packed = _packed(128, in_features, seed=in_features)
        adopted = kernel.adopt(packed, 128, in_features)
        assert adopted is not None
        x = torch.randn(9, in_features)
        _check(adopted.matmul(x), x, weight)
    weight, packed = _packed(128, 96, seed=3)
    adopted = kernel.adopt(packed, 128, 96)
    assert adopted is not None
    x = torch.randn(20, 200)[:, 50:146]  # rows 200 elements apart
    _check(adopted.matmul(x), x, weight)


def test_each_weight_is_read_in_the_panel_width_onednn_chose_for_it() -> None:
    """oneDNN's AVX2 layouts use 64-column panels for most shapes and 16 for some (N = 192
    on the CPUs seen); the probe finds which, and a kernel of the other width is refused."""
    kernel = _kernel()
    widths = set()
    for out_features in (64, 192, 256, 320, 1024):
        weight, packed = _packed(out_features, 128, seed=out_features)
        adopted = kernel.adopt(packed, out_features, 128)
        assert adopted is not None, out_features
        assert isinstance(adopted.kernel, Avx2Linear)
        widths.add(adopted.kernel.panel)
        x = torch.randn(13, 128)
        _check(adopted.matmul(x), x, weight)
    assert widths <= {16, 64} and 64 in widths


def test_refuses_what_it_cannot_read() -> None:
    kernel = _kernel()
    _, packed = _packed(100, 64, seed=0)
    assert kernel.adopt(packed, 100, 64) is None  # columns off the 64-wide panels
    weight, _ = _packed(64, 64, seed=0)
    plain = weight.to_mkldnn()  # the right size in another layout: the probe catches it
    assert kernel.adopt(plain, 64, 64) is None
    _, packed = _packed(64, 64, seed=0)
    adopted = kernel.adopt(packed, 64, 64)
    assert adopted is not None
    with pytest.raises(ValueError, match="refused"):
        adopted.matmul(torch.zeros(MAX_ROWS + 1, 64))


def test_packed_layers_use_the_kernel_only_where_it_applies() -> None:
    kernel = _kernel()
    group = SingleRankGroup()
    plain = ColumnParallelLinear(256, 192, bias=False, group=group)
    biased = RowParallelLinear(256, 192, bias=True, group=group)
    for layer in (plain, biased):
        layer.weight.data = torch.randn(192, 256) * 0.05
    # The layer's bias starts as torch.empty (a checkpoint fills it): left so, it can hold
    # 1e13 garbage whose rounding alone breaks any absolute tolerance.
    assert biased.bias is not None
    biased.bias.data = torch.randn(192)
    weights = {id(layer): layer.weight.detach().clone() for layer in (plain, biased)}
    assert pack_linear_weights(plain, CPU, torch.float32) == 1
    assert pack_linear_weights(biased, CPU, torch.float32) == 1
    assert plain.native is not None and isinstance(plain.native.kernel, Avx2Linear)
    del kernel
    for rows in (1, 48, 300):
        x = torch.randn(rows, 256)
        _check(plain(x), x, weights[id(plain)])
        assert biased.bias is not None
        expected = F.linear(x.double(), weights[id(biased)].double(), biased.bias.double())
        assert (biased(x).double() - expected).abs().max().item() <= 1e-4
    # The biased layer and batches past MAX_ROWS go to oneDNN: its products, bit for bit.
    assert plain.packed is not None and biased.packed is not None
    for layer, x in ((plain, torch.randn(MAX_ROWS + 1, 256)), (biased, torch.randn(4, 256))):
        onednn = torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")
        assert torch.equal(layer(x), onednn)


# 640 x 1000: 64-column panels, K across chunks; 192 x 128: oneDNN's 16-column ones on AVX2
# CPUs (halves of six), 64-column ones where it packs for AVX-512 (TANDEM_CPU_ISA=avx2 on an
# AVX-512 CPU: halves off the panels, not fused). Rows across the register blocks and up to
# the fused call's 128-row groups.
@pytest.mark.parametrize(("halves", "in_features"), [(320, 1000), (96, 128)])
@pytest.mark.parametrize("rows", [1, 7, 48, 128])
def test_silu_in_the_epilogue_is_the_unfused_activation_bit_for_bit(
    halves: int, in_features: int, rows: int
) -> None:
    """A gate/up layer's fused product against the plain product then the elementwise
    SiLU-and-mul kernel: the same sums in the same order, then the same operations (both
    libraries built without FMA contraction), so equal to the bit."""
    _kernel()
    act = native_elementwise()
    if act is None:
        pytest.skip("no native elementwise kernels here")
    layer = MergedColumnParallelLinear(
        in_features, [halves, halves], bias=False, group=SingleRankGroup()
    )
    layer.weight.data = _packed(2 * halves, in_features, seed=rows)[0]
    assert pack_linear_weights(layer, CPU, torch.float32) == 1
    assert layer.native is not None and isinstance(layer.native.kernel, Avx2Linear)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1))
    got = layer.silu_matmul(x)
    if halves % layer.native.kernel.panel != 0:
        assert got is None
        return
    assert got is not None and got.shape == (rows, halves)
    assert torch.equal(got, act.silu_mul(layer(x)))


def test_the_fused_silu_covers_every_group_of_rows() -> None:
    """Past 128 rows (a kernel taking more than serving hands it) the fused call sums the
    rows a group at a time: 300 rows are three."""
    kernel = _kernel().taking_rows(300)
    act = native_elementwise()
    if act is None:
        pytest.skip("no native elementwise kernels here")
    _, packed = _packed(256, 200, seed=3)
    adopted = kernel.adopt(packed, 256, 200)
    assert adopted is not None
    x = torch.randn(300, 200, generator=torch.Generator().manual_seed(2))
    got = adopted.kernel.silu_matmul(x, adopted)
    assert got is not None and torch.equal(got, act.silu_mul(adopted.matmul(x)))


def test_silu_is_fused_only_where_the_kernel_reads_both_halves() -> None:
    _kernel()
    group = SingleRankGroup()
    fits = MergedColumnParallelLinear(256, [128, 128], bias=False, group=group)
    biased = MergedColumnParallelLinear(256, [128, 128], bias=True, group=group)
    for layer in (fits, biased):
        layer.weight.data = torch.randn(layer.weight.shape) * 0.05
        assert pack_linear_weights(layer, CPU, torch.float32) == 1
        assert layer.native is not None and isinstance(layer.native.kernel, Avx2Linear)
    x = torch.randn(5, 256)
    assert fits.silu_matmul(x) is not None
    assert biased.silu_matmul(x) is None  # the kernel adds no bias
    assert fits.silu_matmul(torch.randn(MAX_ROWS + 1, 256)) is None  # oneDNN's


def test_the_kernel_exists_exactly_where_the_isa_level_has_avx2() -> None:
    flags = selected_isa().cpu_flags()
    if not packing_enabled(torch.float32):
        pytest.skip("no oneDNN packing in this torch")
    assert (avx2_linear() is not None) == ({"avx2", "fma"} <= flags)
