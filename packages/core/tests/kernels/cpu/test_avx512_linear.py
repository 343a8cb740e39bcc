"""The AVX-512 kernels read oneDNN's packed float32 and bfloat16 weights and give their
products at decode batch sizes; they adopt only weights they were checked on, and packed
layers route through them only where they apply (their dtype, at most MAX_ROWS rows, no
bias)."""

from __future__ import annotations

import math
from functools import cache

import pytest
import torch
import torch.nn.functional as F

from tandem.collectives import SingleRankGroup
from tandem.core.kernels.cpu.avx512_linear import (
    MAX_ROWS,
    Avx512Kernels,
    Avx512Linear,
    WeightStreaming,
    avx512_linear,
    load_avx512_linear,
)
from tandem.core.kernels.cpu.elementwise import native_elementwise
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
DTYPES = [torch.float32, torch.bfloat16]


def _kernel(dtype: torch.dtype) -> Avx512Linear:
    kernels = avx512_linear()
    kernel: Avx512Linear | None = None
    if kernels is not None:
        kernel = kernels.float32 if dtype is torch.float32 else kernels.bfloat16
    if kernel is None or not packing_enabled(dtype):
        pytest.skip(f"no AVX-512 kernel for {dtype} on this CPU (or no oneDNN packing)")
    if native_kernel(dtype) is not kernel:
        pytest.skip(f"{dtype} weights go to another kernel on this CPU (AMX)")
    return kernel


@cache
def _streamed_kernels(streaming: WeightStreaming) -> Avx512Kernels | None:
    return load_avx512_linear(streaming=streaming)


def _streamed(dtype: torch.dtype, streaming: WeightStreaming) -> Avx512Linear:
    """The kernel built with ``streaming`` (each CPU vendor's; either runs on any AVX-512
    CPU), called directly rather than through the layers; where this CPU's own build serves
    ``dtype`` (on AMX CPUs oneDNN packs bfloat16 for AMX, a layout this kernel does not read)."""
    _kernel(dtype)
    kernels = _streamed_kernels(streaming)
    name = str(dtype).removeprefix("torch.")
    kernel: Avx512Linear | None = None if kernels is None else getattr(kernels, name)
    assert kernel is not None
    return kernel


def _packed(
    out_features: int, in_features: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(dtype)
    return weight, torch.ops.mkldnn._reorder_linear_weight(weight, 128)


def _reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.double() @ weight.double().T


def _tolerance(dtype: torch.dtype, exact: torch.Tensor, in_features: int) -> float:
    scale = float(exact.abs().max())
    if dtype is torch.bfloat16:
        return 8e-3 * scale  # one bfloat16 rounding of each output (and a float32 sum)
    # A float32 FMA chain over K terms: a few float32 roundings of the running sum.
    return 1e-5 * scale * math.sqrt(in_features)


# K below one chunk, across the chunk edges (128 and 384 steps), and the bench model's
# down_proj; one row block (each streaming's own prefetch), up to 16 (short chunks with L2
# streaming) and more.
@pytest.mark.parametrize("streaming", list(WeightStreaming))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 32), (128, 96), (192, 1024), (1024, 2816)])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 41, 48, 96, 97, 128])
def test_products_match_float64(
    dtype: torch.dtype, shape: tuple[int, int], rows: int, streaming: WeightStreaming
) -> None:
    kernel = _streamed(dtype, streaming)
    out_features, in_features = shape
    weight, packed = _packed(out_features, in_features, dtype, seed=rows)
    adopted = kernel.adopt(packed, out_features, in_features)
    assert adopted is not None
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1)).to(dtype)

    got = adopted.matmul(x)
    assert got.dtype is dtype and got.shape == (rows, out_features)
    exact = _reference(x, weight)
    assert (got.double() - exact).abs().max().item() <= _tolerance(dtype, exact, in_features)


# Prefill sizes: row groups of 512, the last one partial (L2 streaming: equal groups of
# about 128 rows).
@pytest.mark.parametrize("streaming", list(WeightStreaming))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [512, 515, 1100])
def test_prefill_size_batches_pass_in_row_groups(
    dtype: torch.dtype, rows: int, streaming: WeightStreaming
) -> None:
    kernel = _streamed(dtype, streaming)
    weight, packed = _packed(192, 1024, dtype, seed=rows)
    adopted = kernel.adopt(packed, 192, 1024)
    assert adopted is not None
    x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(2)).to(dtype)
    exact = _reference(x, weight)
    got = adopted.matmul(x)
    assert (got.double() - exact).abs().max().item() <= _tolerance(dtype, exact, 1024)


def test_float32_reads_weights_whose_k_onednn_padded() -> None:
    kernel = _kernel(torch.float32)
    for in_features in (1, 100, 1000):
        weight, packed = _packed(128, in_features, torch.float32, seed=in_features)
        adopted = kernel.adopt(packed, 128, in_features)
        assert adopted is not None
        x = torch.randn(9, in_features)
        exact = _reference(x, weight)
        tol = _tolerance(torch.float32, exact, in_features)
        assert (adopted.matmul(x).double() - exact).abs().max().item() <= tol


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_of_a_strided_batch_read_their_own_input(dtype: torch.dtype) -> None:
    kernel = _kernel(dtype)
    weight, packed = _packed(128, 96, dtype, seed=3)
    adopted = kernel.adopt(packed, 128, 96)
    assert adopted is not None
    wide = torch.randn(20, 200).to(dtype)
    x = wide[:, 50:146]  # rows 200 elements apart
    exact = _reference(x, weight)
    got = adopted.matmul(x)
    assert (got.double() - exact).abs().max().item() <= _tolerance(dtype, exact, 96)


@pytest.mark.parametrize("dtype", DTYPES)
def test_refuses_what_it_cannot_read(dtype: torch.dtype) -> None:
    kernel = _kernel(dtype)
    # Columns off the 64-wide panels: oneDNN pads them, the kernel does not walk padding.
    _, packed = _packed(100, 64, dtype, seed=0)
    assert kernel.adopt(packed, 100, 64) is None
    # A buffer of the right size in another layout (oneDNN's plain one): the probe product
    # pairs the wrong weights and the weight is not adopted.
    weight, _ = _packed(64, 64, dtype, seed=0)
    plain = weight.to_mkldnn()
    assert int(torch.ops.mkldnn._nbytes(plain)) == 64 * 64 * weight.element_size()
    assert kernel.adopt(plain, 64, 64) is None
    # More rows than the kernel takes: an error, not a wrong product.
    _, packed = _packed(64, 64, dtype, seed=0)
    adopted = kernel.adopt(packed, 64, 64)
    assert adopted is not None
    with pytest.raises(ValueError, match="refused"):
        adopted.matmul(torch.zeros(MAX_ROWS + 1, 64, dtype=dtype))


def test_bfloat16_takes_no_k_that_onednn_pads() -> None:
    kernel = _kernel(torch.bfloat16)
    _, packed = _packed(64, 40, torch.bfloat16, seed=0)
    assert kernel.adopt(packed, 64, 40) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_layers_use_the_kernel_only_where_it_applies(dtype: torch.dtype) -> None:
    kernel = _kernel(dtype)
    group = SingleRankGroup()
    plain = ColumnParallelLinear(256, 192, bias=False, group=group).to(dtype)
    biased = RowParallelLinear(256, 192, bias=True, group=group).to(dtype)
    for layer in (plain, biased):
        layer.weight.data = (torch.randn(192, 256) * 0.05).to(dtype)
    assert biased.bias is not None
    biased.bias.data = torch.randn(192).to(dtype)
    weights = {id(layer): layer.weight.detach().clone() for layer in (plain, biased)}
    assert pack_linear_weights(plain, CPU, dtype) == 1
    assert pack_linear_weights(biased, CPU, dtype) == 1
    for layer in (plain, biased):
        assert layer.native is not None and layer.native.kernel is kernel

    for rows in (1, 48, MAX_ROWS, MAX_ROWS + 1, 300):
        x = torch.randn(rows, 256).to(dtype)
        for layer in (plain, biased):
            bias = layer.bias.double() if layer.bias is not None else None
            expected = F.linear(x.double(), weights[id(layer)].double(), bias)
            got = layer(x)
            assert got.shape == (rows, 192)
            tol = _tolerance(dtype, expected, 256) + (1e-5 if bias is not None else 0.0)
            assert (got.double() - expected).abs().max().item() <= tol
    # The biased layer and the large batches went to oneDNN: its products, bit for bit.
    assert plain.packed is not None and biased.packed is not None
    for layer, x in ((plain, torch.randn(MAX_ROWS + 1, 256)), (biased, torch.randn(4, 256))):
        x = x.to(dtype)
        onednn = torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")
        assert torch.equal(layer(x), onednn)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 48, 600])
@pytest.mark.parametrize("in_features", [256, 1024])
def test_silu_in_the_epilogue_is_the_unfused_activation_bit_for_bit(
    dtype: torch.dtype, rows: int, in_features: int
) -> None:
    """A gate/up layer's fused product against the plain product then the elementwise
    SiLU-and-mul kernel: the same sums, rounded the same way, then the same operations (both
    libraries built without FMA contraction), so equal to the bit. 600 rows: two row
    groups; K 1024: chunks of the panels."""
    kernel = _kernel(dtype)
    act = native_elementwise()
    if act is None:
        pytest.skip("no native elementwise kernels here")
    layer = MergedColumnParallelLinear(in_features, [320, 320], bias=False, group=SingleRankGroup())
    layer.weight.data = _packed(640, in_features, dtype, seed=rows)[0]
    assert pack_linear_weights(layer, CPU, dtype) == 1
    assert layer.native is not None and layer.native.kernel is kernel
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = layer.silu_matmul(x)
    assert got is not None and got.shape == (rows, 320)
    assert torch.equal(got, act.silu_mul(layer(x)))


@pytest.mark.parametrize("streaming", list(WeightStreaming))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 48, 200, 600])
def test_each_streamings_fused_silu_is_its_plain_product_then_the_activation(
    dtype: torch.dtype, rows: int, streaming: WeightStreaming
) -> None:
    """As above, on the kernel itself, for the streaming of either vendor: one row block,
    8 (short chunks with L2 streaming), 34 (long ones), 600 rows (two groups, or five of
    120 with L2 streaming); K 1024 cut into chunks."""
    kernel = _streamed(dtype, streaming)
    assert kernel.detail == streaming.description  # what the start-up report says of it
    act = native_elementwise()
    if act is None:
        pytest.skip("no native elementwise kernels here")
    _, packed = _packed(256, 1024, dtype, seed=rows)
    adopted = kernel.adopt(packed, 256, 1024)
    assert adopted is not None
    x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(4)).to(dtype)
    got = kernel.silu_matmul(x, adopted)
    assert got is not None and got.shape == (rows, 128)
    assert torch.equal(got, act.silu_mul(adopted.matmul(x)))


def test_each_vendor_gets_its_weight_streaming() -> None:
    assert WeightStreaming.for_vendor("GenuineIntel") is WeightStreaming.L2
    assert WeightStreaming.for_vendor("AuthenticAMD") is WeightStreaming.NTA
    assert WeightStreaming.for_vendor("") is WeightStreaming.NTA
    assert WeightStreaming.L2.defines == ("TANDEM_STREAM_TO_L2",)
    assert WeightStreaming.NTA.defines == ()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_is_fused_only_where_the_kernel_reads_both_halves(dtype: torch.dtype) -> None:
    kernel = _kernel(dtype)
    group = SingleRankGroup()
    fits = MergedColumnParallelLinear(256, [128, 128], bias=False, group=group)
    off_panels = MergedColumnParallelLinear(256, [96, 96], bias=False, group=group)
    biased = MergedColumnParallelLinear(256, [128, 128], bias=True, group=group)
    for layer in (fits, off_panels, biased):
        layer.weight.data = (torch.randn(layer.weight.shape) * 0.05).to(dtype)
        assert pack_linear_weights(layer, CPU, dtype) == 1
        assert layer.native is not None and layer.native.kernel is kernel
    x = torch.randn(5, 256).to(dtype)
    assert fits.silu_matmul(x) is not None
    assert off_panels.silu_matmul(x) is None  # 96 columns a half: off the 64-column panels
    assert biased.silu_matmul(x) is None  # the kernel adds no bias
    assert fits.silu_matmul(torch.randn(MAX_ROWS + 1, 256).to(dtype)) is None  # oneDNN's
