"""The AVX-512 kernel reads oneDNN's packed float32 weights and gives float32 products at
decode batch sizes; it adopts only weights it was checked on, and packed layers route through
it only where it applies (float32, at most MAX_ROWS rows, no bias)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.collectives import SingleRankGroup
from tandem.core.layers.avx512_linear import MAX_ROWS, Avx512Linear, avx512_linear
from tandem.core.layers.linear import ColumnParallelLinear, RowParallelLinear
from tandem.core.layers.packed_linear import pack_linear_weights, packing_enabled

CPU = torch.device("cpu")


def _kernel() -> Avx512Linear:
    kernel = avx512_linear()
    if kernel is None or not packing_enabled(torch.float32):
        pytest.skip("no AVX-512 on this CPU (or no oneDNN float32 packing)")
    return kernel


def _packed(out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05
    return weight, torch.ops.mkldnn._reorder_linear_weight(weight, 128)


def _reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x.double() @ weight.double().T).float()


# K below one chunk, across chunk edges (384), and the bench model's down_proj (2816).
@pytest.mark.parametrize("shape", [(64, 32), (128, 100), (192, 1000), (1024, 2816)])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 41, 48, 127, 128])
def test_products_match_float64_to_float32_rounding(shape: tuple[int, int], rows: int) -> None:
    kernel = _kernel()
    out_features, in_features = shape
    weight, packed = _packed(out_features, in_features, seed=rows)
    adopted = kernel.adopt(packed, out_features, in_features)
    assert adopted is not None
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1))

    got = adopted.matmul(x)
    assert got.dtype is torch.float32 and got.shape == (rows, out_features)
    exact = _reference(x, weight)
    # A float32 FMA chain over K terms: a few float32 roundings of the running sum.
    assert (got - exact).abs().max().item() <= 1e-5 * exact.abs().max().item() * in_features**0.5


def test_rows_of_a_strided_batch_read_their_own_input() -> None:
    kernel = _kernel()
    weight, packed = _packed(128, 96, seed=3)
    adopted = kernel.adopt(packed, 128, 96)
    assert adopted is not None
    wide = torch.randn(20, 200)
    x = wide[:, 50:146]  # rows 200 elements apart
    expected = _reference(x, weight)
    got = adopted.matmul(x)
    assert (got - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


def test_refuses_what_it_cannot_read() -> None:
    kernel = _kernel()
    # Columns off the 64-wide panels: oneDNN pads them, the kernel does not walk padding.
    _, packed = _packed(100, 64, seed=0)
    assert kernel.adopt(packed, 100, 64) is None
    # A buffer of the right size in another layout (oneDNN's plain one): the probe product
    # pairs the wrong weights and the weight is not adopted.
    weight, _ = _packed(64, 64, seed=0)
    plain = weight.to_mkldnn()
    assert int(torch.ops.mkldnn._nbytes(plain)) == 64 * 64 * 4
    assert kernel.adopt(plain, 64, 64) is None
    # More rows than the kernel takes: an error, not a wrong product.
    _, packed = _packed(64, 64, seed=0)
    adopted = kernel.adopt(packed, 64, 64)
    assert adopted is not None
    with pytest.raises(ValueError, match="refused"):
        adopted.matmul(torch.zeros(MAX_ROWS + 1, 64))


def test_packed_layers_use_the_kernel_only_where_it_applies() -> None:
    _kernel()
    group = SingleRankGroup()
    plain = ColumnParallelLinear(256, 192, bias=False, group=group)
    biased = RowParallelLinear(256, 192, bias=True, group=group)
    for layer in (plain, biased):
        layer.weight.data = torch.randn(192, 256) * 0.05
    assert biased.bias is not None
    biased.bias.data = torch.randn(192)
    weights = {id(layer): layer.weight.detach().clone() for layer in (plain, biased)}
    assert pack_linear_weights(plain, CPU, torch.float32) == 1
    assert pack_linear_weights(biased, CPU, torch.float32) == 1
    for layer in (plain, biased):
        assert layer.small_batch is not None and isinstance(layer.small_batch.kernel, Avx512Linear)

    for rows in (1, 48, MAX_ROWS, MAX_ROWS + 1, 300):
        x = torch.randn(rows, 256)
        for layer in (plain, biased):
            bias = layer.bias.double() if layer.bias is not None else None
            expected = F.linear(x.double(), weights[id(layer)].double(), bias)
            got = layer(x)
            assert got.shape == (rows, 192)
            assert (got.double() - expected).abs().max().item() <= 1e-5
    # The biased layer and the large batches went to oneDNN: its products, bit for bit.
    assert plain.packed is not None and biased.packed is not None
    for layer, x in ((plain, torch.randn(MAX_ROWS + 1, 256)), (biased, torch.randn(4, 256))):
        onednn = torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")
        assert torch.equal(layer(x), onednn)


def test_bfloat16_layers_are_not_adopted_by_the_float32_kernel() -> None:
    _kernel()
    if not packing_enabled(torch.bfloat16):
        pytest.skip("oneDNN cannot pack bfloat16 weights on this CPU")
    layer = ColumnParallelLinear(64, 64, bias=False, group=SingleRankGroup()).bfloat16()
    assert pack_linear_weights(layer, CPU, torch.bfloat16) == 1
    assert layer.packed is not None
    assert layer.small_batch is None or not isinstance(layer.small_batch.kernel, Avx512Linear)
