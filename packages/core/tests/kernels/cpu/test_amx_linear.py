"""The AMX kernel reads oneDNN's packed bfloat16 weights and gives oneDNN's products at decode
batch sizes; it adopts only weights it was checked on, and packed layers route through it
only where it applies (bfloat16, at most MAX_ROWS rows, no bias). On AMX CPUs only, except
its test build on emulated tiles, which every CPU runs on weights laid out as oneDNN lays
them out for AMX (the last tests; on AMX CPUs one checks that layout against oneDNN's)."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from tandem.collectives import SingleRankGroup
from tandem.core.kernels.cpu.amx_linear import (
    MAX_ROWS,
    AmxLinear,
    amx_linear,
    load_amx_linear,
    pack_amx_layout,
)
from tandem.core.kernels.cpu.elementwise import native_elementwise
from tandem.core.kernels.cpu.native_linear import AdoptedWeight
from tandem.core.kernels.cpu.packed_linear import pack_linear_weights, packing_enabled
from tandem.core.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)

CPU = torch.device("cpu")


def _kernel() -> AmxLinear:
    kernel = amx_linear()
    if kernel is None or not packing_enabled(torch.bfloat16):
        pytest.skip("no AMX-BF16 on this CPU (or no oneDNN bfloat16 packing)")
    return kernel


def _packed(out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(torch.bfloat16)
    return weight, torch.ops.mkldnn._reorder_linear_weight(weight, 128)


def _onednn(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return out


@pytest.mark.parametrize("shape", [(64, 32), (96, 160), (1024, 2816), (2048, 1024)])
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 33, 48, 64])
def test_products_match_onednn_and_float32(shape: tuple[int, int], rows: int) -> None:
    kernel = _kernel()
    out_features, in_features = shape
    weight, packed = _packed(out_features, in_features, seed=rows)
    adopted = kernel.adopt(packed, out_features, in_features)
    assert adopted is not None
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1)).bfloat16()

    got = adopted.matmul(x)
    assert got.dtype is torch.bfloat16 and got.shape == (rows, out_features)
    exact = x.float() @ weight.float().T
    scale = exact.abs().max().item()
    # One bfloat16 rounding of each output (and a float32 sum in another order).
    assert (got.float() - exact).abs().max().item() <= 8e-3 * scale
    assert (got.float() - _onednn(x, packed).float()).abs().max().item() <= 8e-3 * scale


def test_rows_of_a_strided_batch_read_their_own_input() -> None:
    kernel = _kernel()
    weight, packed = _packed(128, 96, seed=3)
    adopted = kernel.adopt(packed, 128, 96)
    assert adopted is not None
    wide = torch.randn(20, 200).bfloat16()
    x = wide[:, 50:146]  # rows 200 elements apart
    expected = x.float() @ weight.float().T
    got = adopted.matmul(x)
    assert (got.float() - expected).abs().max().item() <= 8e-3 * expected.abs().max().item()


def test_refuses_what_it_cannot_read() -> None:
    kernel = _kernel()
    # Shapes off the 32-blocks: oneDNN pads them, the kernel does not walk padding.
    _, packed = _packed(100, 64, seed=0)
    assert kernel.adopt(packed, 100, 64) is None
    _, packed = _packed(64, 48, seed=0)
    assert kernel.adopt(packed, 64, 48) is None
    # A buffer of the right size in another layout (oneDNN's plain one): the probe product
    # pairs the wrong weights and the weight is not adopted.
    weight, _ = _packed(64, 64, seed=0)
    plain = weight.to_mkldnn()
    assert int(torch.ops.mkldnn._nbytes(plain)) == 64 * 64 * 2
    assert kernel.adopt(plain, 64, 64) is None
    # More rows than the kernel takes: an error, not a wrong product.
    _, packed = _packed(64, 64, seed=0)
    adopted = kernel.adopt(packed, 64, 64)
    assert adopted is not None
    with pytest.raises(ValueError, match="refused"):
        adopted.matmul(torch.zeros(MAX_ROWS + 1, 64, dtype=torch.bfloat16))


def test_packed_layers_use_the_kernel_only_where_it_applies() -> None:
    _kernel()
    group = SingleRankGroup()
    plain = ColumnParallelLinear(256, 192, bias=False, group=group).to(torch.bfloat16)
    biased = RowParallelLinear(256, 192, bias=True, group=group).to(torch.bfloat16)
    for layer in (plain, biased):
        layer.weight.data = (torch.randn(192, 256) * 0.05).bfloat16()
    assert biased.bias is not None  # torch.empty until set: it could hold NaN or 1e13
    biased.bias.data = torch.randn(192).bfloat16()
    weights = {id(layer): layer.weight.detach().clone() for layer in (plain, biased)}
    assert pack_linear_weights(plain, CPU, torch.bfloat16) == 1
    assert pack_linear_weights(biased, CPU, torch.bfloat16) == 1
    for layer in (plain, biased):
        assert layer.native is not None and isinstance(layer.native.kernel, AmxLinear)

    for rows in (1, 48, MAX_ROWS, MAX_ROWS + 1, 300):
        x = torch.randn(rows, 256).bfloat16()
        for layer in (plain, biased):
            bias = layer.bias.float() if layer.bias is not None else None
            expected = F.linear(x.float(), weights[id(layer)].float(), bias)
            got = layer(x)
            assert got.shape == (rows, 192)
            tol = 8e-3 * expected.abs().max().item()
            assert (got.float() - expected).abs().max().item() <= tol
    # The biased layer and the large batches went to oneDNN: its products, bit for bit.
    x = torch.randn(MAX_ROWS + 1, 256).bfloat16()
    assert plain.packed is not None
    assert torch.equal(plain(x), _onednn(x, plain.packed))


def test_float32_layers_are_not_adopted_by_the_amx_kernel() -> None:
    _kernel()
    if not packing_enabled(torch.float32):
        pytest.skip("oneDNN cannot pack float32 weights on this build")
    layer = ColumnParallelLinear(64, 64, bias=False, group=SingleRankGroup())
    assert pack_linear_weights(layer, CPU, torch.float32) == 1
    assert layer.packed is not None
    assert layer.native is None or not isinstance(layer.native.kernel, AmxLinear)


# --- The kernel on emulated tiles (csrc/amx_tiles.h): every CPU runs its walk of the layout.


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory) -> AmxLinear:
    kernel = load_amx_linear(tmp_path_factory.mktemp("amx-emulated"), emulated=True)
    if kernel is None:
        pytest.skip("no C++ compiler")
    assert kernel.emulated
    return kernel


def _laid_out(kernel: AmxLinear, weight: torch.Tensor) -> AdoptedWeight:
    """``weight`` in the layout the source documents, as the kernel would adopt it."""
    packed = pack_amx_layout(weight)
    assert packed.data_ptr() % 64 == 0
    return AdoptedWeight(kernel, packed, weight.shape[0], weight.shape[1], packed.data_ptr())


@pytest.mark.parametrize("shape", [(32, 32), (96, 160), (256, 512)])
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 33, 48, 64])
def test_the_emulated_kernel_computes_the_product(
    emulated: AmxLinear, shape: tuple[int, int], rows: int
) -> None:
    """Every pass (two x tiles, then one) and partial-tile store, on one to four tiles of
    rows. Bound: as for oneDNN's kernel above, one bfloat16 rounding of each output (2^-8
    relative to the largest) plus float32 sums of at most 512 exact products in another order,
    far below it."""
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    got = _laid_out(emulated, weight).matmul(x)
    exact = x.float() @ weight.float().T
    assert got.dtype is torch.bfloat16 and got.shape == (rows, out_features)
    assert (got.float() - exact).abs().max().item() <= 8e-3 * exact.abs().max().item()


def test_the_emulated_kernel_reads_strided_rows(emulated: AmxLinear) -> None:
    weight = (torch.randn(64, 96) * 0.05).bfloat16()
    x = torch.randn(20, 200).bfloat16()[:, 50:146]  # rows 200 elements apart
    exact = x.float() @ weight.float().T
    got = _laid_out(emulated, weight).matmul(x)
    assert (got.float() - exact).abs().max().item() <= 8e-3 * exact.abs().max().item()


def test_the_documented_layout_is_onednns() -> None:
    """Where oneDNN packs for AMX, its buffer holds the bytes ``pack_amx_layout`` writes: the
    emulated kernel's tests then cover the layout the real kernel reads."""
    kernel = _kernel()
    weight, packed = _packed(96, 160, seed=4)
    assert kernel.adopt(packed, 96, 160) is not None
    raw = ctypes.string_at(int(torch.ops.mkldnn.data_ptr(packed)), 96 * 160 * 2)
    # numpy has no bfloat16: the bytes through an int16 view.
    assert raw == pack_amx_layout(weight).view(torch.int16).numpy().tobytes()


@pytest.mark.parametrize("rows", [1, 17, 48, 64])
@pytest.mark.parametrize("in_features", [256, 1024])
def test_silu_in_the_epilogue_is_the_unfused_activation_bit_for_bit(
    rows: int, in_features: int
) -> None:
    """A gate/up layer's fused product against the plain product then the elementwise
    SiLU-and-mul kernel: the same sums, rounded the same way, then the same operations (both
    libraries built without FMA contraction), so equal to the bit."""
    kernel = _kernel()
    act = native_elementwise()
    if act is None:
        pytest.skip("no native elementwise kernels here")
    layer = MergedColumnParallelLinear(in_features, [320, 320], bias=False, group=SingleRankGroup())
    layer.weight.data = _packed(640, in_features, seed=rows)[0]
    assert pack_linear_weights(layer, CPU, torch.bfloat16) == 1
    assert layer.native is not None and layer.native.kernel is kernel
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1)).bfloat16()
    got = layer.silu_matmul(x)
    assert got is not None and got.shape == (rows, 320)
    assert torch.equal(got, act.silu_mul(layer(x)))


def test_silu_is_fused_only_where_the_kernel_reads_both_halves() -> None:
    kernel = _kernel()
    group = SingleRankGroup()
    fits = MergedColumnParallelLinear(256, [96, 96], bias=False, group=group)
    off_units = MergedColumnParallelLinear(256, [48, 48], bias=False, group=group)
    biased = MergedColumnParallelLinear(256, [128, 128], bias=True, group=group)
    for layer in (fits, off_units, biased):
        layer.weight.data = (torch.randn(layer.weight.shape) * 0.05).bfloat16()
        assert pack_linear_weights(layer, CPU, torch.bfloat16) == 1
    assert fits.native is not None and fits.native.kernel is kernel
    assert biased.native is not None  # adopted; only the fused call declines it
    x = torch.randn(5, 256).bfloat16()
    assert fits.silu_matmul(x) is not None
    assert off_units.silu_matmul(x) is None  # 48 columns a half: off the 32-column units
    assert biased.silu_matmul(x) is None  # the kernel adds no bias
    assert fits.silu_matmul(torch.randn(MAX_ROWS + 1, 256).bfloat16()) is None  # oneDNN's


@pytest.mark.parametrize("rows", [1, 17, 33, 64])
def test_the_emulated_kernel_fuses_silu_as_the_elementwise_kernel_does(
    emulated: AmxLinear, rows: int
) -> None:
    act = native_elementwise()
    if act is None:
        pytest.skip("no native elementwise kernels here")
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(128, 96, generator=gen) * 0.05).bfloat16()
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    adopted = _laid_out(emulated, weight)
    got = emulated.silu_matmul(x, adopted)
    assert got is not None and got.shape == (rows, 64)
    assert torch.equal(got, act.silu_mul(adopted.matmul(x)))
