"""Weights packed once into oneDNN's layout give F.linear's results, free the plain copy unless
another module shares it, and are counted in the model's weight bytes."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tandem.collectives import SingleRankGroup
from tandem.core.kernels.cpu import packed_linear
from tandem.core.kernels.cpu.packed_linear import (
    native_kernel,
    pack_linear_weights,
    packed_bytes,
    packing_enabled,
    padded_rows,
)
from tandem.core.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tandem.core.layers.linear import ColumnParallelLinear, RowParallelLinear
from tandem.core.layers.replicated_linear import ReplicatedLinear
from tandem.core.layers.weights import parameter_bytes
from tandem.device.cpu import collapse_to_huge_pages

CPU = torch.device("cpu")
# float32: the same products summed in another order; bfloat16: one rounding of the output.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _need_packing(dtype: torch.dtype) -> None:
    if not packing_enabled(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} weights on this build or CPU")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 48, 300])
def test_packed_layers_match_f_linear(dtype: torch.dtype, rows: int) -> None:
    _need_packing(dtype)
    gen = torch.Generator().manual_seed(rows)
    layer = RowParallelLinear(96, 80, bias=True, group=SingleRankGroup()).to(dtype)
    layer.weight.data = torch.randn(80, 96, generator=gen).to(dtype)
    layer.bias.data = torch.randn(80, generator=gen).to(dtype)  # type: ignore[union-attr]
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    expected = F.linear(x.float(), layer.weight.float(), layer.bias.float())  # type: ignore[union-attr]

    assert pack_linear_weights(layer, CPU, dtype) == 1
    assert layer.packed is not None and layer.weight.numel() == 0
    got = layer(x)
    assert got.dtype is dtype and got.shape == (rows, 80)
    scale = expected.abs().max().item()
    assert (got.float() - expected).abs().max().item() <= TOLERANCE[dtype] * scale
    # A row taken out of a larger batch (the sampled rows of a step) is not contiguous-safe
    # by accident: the packed path must give each row what F.linear gives it.
    picked = x[::2]
    assert torch.allclose(layer(picked).float(), got[::2].float(), rtol=0, atol=1e-6 * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pad", [False, True], ids=["as-is", "padded"])
def test_a_layer_off_the_panels_is_padded_only_where_allowed(dtype: torch.dtype, pad: bool) -> None:
    """80 outputs: off the 64-column panels of our kernels. Allowed, the packed weight carries
    zero rows up to the width the kernel reads and the layer still gives F.linear's 80 columns,
    through our kernel (2-D) and oneDNN (3-D input); else it stays as it is, with oneDNN."""
    _need_packing(dtype)
    gen = torch.Generator().manual_seed(5)
    layer = ReplicatedLinear(96, 80)
    layer.weight.data = torch.randn(80, 96, generator=gen).to(dtype)
    layer.pad_outputs = pad
    x = torch.randn(2, 7, 96, generator=gen).to(dtype)
    expected = F.linear(x.float(), layer.weight.float())
    pack_linear_weights(layer, CPU, dtype)
    kernel = native_kernel(dtype)
    read = kernel is not None and pad  # 96 inputs, bfloat16's K multiple of 32 too
    assert (layer.native is not None) == read
    # Up to the kernel's panels: 128 on AVX-512's 64 columns, 96 on AMX's 32 (others: the
    # width the kernel itself says it reads).
    pads = {"AMX": 16, "AVX-512 float32": 48, "AVX512-BF16": 48}
    padding = 0
    if kernel is not None and read:
        padding = pads.get(kernel.name, (kernel.readable_width(80, 96) or 80) - 80)
    assert layer.padded_outputs == padding
    scale = expected.abs().max().item()
    for got, want in [(layer(x), expected), (layer(x[0]), expected[0])]:
        assert got.shape == want.shape and got.dtype is dtype
        assert (got.float() - want).abs().max().item() <= TOLERANCE[dtype] * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_with_a_bias_is_never_padded(dtype: torch.dtype) -> None:
    """oneDNN adds a bias over the packed weight's whole width: 80 outputs padded to 128
    would meet a bias of 80. Asked to pad, such a layer stays as it is and adds its bias."""
    _need_packing(dtype)
    gen = torch.Generator().manual_seed(6)
    layer = ColumnParallelLinear(96, 80, bias=True, group=SingleRankGroup())
    layer.weight.data = torch.randn(80, 96, generator=gen).to(dtype)
    assert layer.bias is not None
    layer.bias.data = torch.randn(80, generator=gen).to(dtype)
    layer.pad_outputs = True
    x = torch.randn(7, 96, generator=gen).to(dtype)
    expected = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    pack_linear_weights(layer, CPU, dtype)
    assert layer.padded_outputs == 0
    got = layer(x)
    assert got.shape == expected.shape
    assert (got.float() - expected).abs().max().item() <= TOLERANCE[
        dtype
    ] * expected.abs().max().item()


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        group = SingleRankGroup()
        self.embed_tokens = VocabParallelEmbedding(64, 32, group)
        self.lm_head = ParallelLMHead(64, 32, group)
        self.lm_head.weight = self.embed_tokens.weight
        self.router = ReplicatedLinear(32, 8)


def test_a_weight_another_module_reads_is_kept_and_bytes_are_counted() -> None:
    _need_packing(torch.float32)
    model = _Tied()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    hidden = torch.randn(5, 32)
    logits = model.lm_head.compute_logits(hidden)
    before = parameter_bytes(model)

    assert pack_linear_weights(model, CPU, torch.float32) == 2
    # The embedding still reads its table; the router's plain weight is gone.
    assert model.embed_tokens.weight.shape == (64, 32)
    assert model.router.weight.numel() == 0
    assert torch.allclose(model.lm_head.compute_logits(hidden), logits, atol=1e-5)
    assert parameter_bytes(model) + packed_bytes(model) >= before
    # The router's outputs padded to the native kernel's panels are packed too.
    router_rows = 8 + model.router.padded_outputs
    assert packed_bytes(model) == (64 * 32 + router_rows * 32) * 4
    # Packing twice is a no-op.
    assert pack_linear_weights(model, CPU, torch.float32) == 0


def test_packing_is_off_off_cpu_and_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = ReplicatedLinear(16, 16)
    assert pack_linear_weights(layer, torch.device("meta"), torch.float32) == 0
    assert pack_linear_weights(layer, CPU, torch.float16) == 0
    monkeypatch.setenv("TANDEM_GEMM", "torch")
    packing_enabled.cache_clear()
    try:
        assert not packing_enabled(torch.float32)
        assert pack_linear_weights(layer, CPU, torch.float32) == 0
        assert layer.packed is None and layer.weight.shape == (16, 16)
    finally:
        monkeypatch.delenv("TANDEM_GEMM")
        packing_enabled.cache_clear()
    assert packed_linear.packing_enabled(torch.float32) is torch._C._has_mkldnn


def test_row_counts_round_to_few_shapes_and_little_padding() -> None:
    counts = range(1, 2049)
    padded = [padded_rows(m) for m in counts]
    assert all(m <= p <= m * 1.125 for m, p in zip(counts, padded, strict=True))
    assert len(set(padded)) <= 80
    # Common batch sizes run as they are.
    assert [padded_rows(m) for m in (1, 8, 16, 48, 64, 256, 2048)] == [1, 8, 16, 48, 64, 256, 2048]


def _three_layers(dtype: torch.dtype) -> nn.Sequential:
    gen = torch.Generator().manual_seed(3)
    model = nn.Sequential(*(ReplicatedLinear(1024, 2048) for _ in range(3)))
    for layer in model:
        layer.weight.data = torch.randn(2048, 1024, generator=gen).to(dtype)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weights_are_moved_to_huge_pages_whole_and_compute_the_same(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    _need_packing(dtype)
    x = torch.randn(48, 1024, generator=torch.Generator().manual_seed(4)).to(dtype)
    monkeypatch.setattr(packed_linear, "collapse_to_huge_pages", lambda ranges: 0)
    unmoved = _three_layers(dtype)
    pack_linear_weights(unmoved, CPU, dtype)
    expected = [layer(x) for layer in unmoved]

    handed: list[tuple[int, int]] = []

    def collapse(ranges: Iterable[tuple[int, int]]) -> int:
        handed.extend(ranges)
        return collapse_to_huge_pages(handed)

    monkeypatch.setattr(packed_linear, "collapse_to_huge_pages", collapse)
    model = _three_layers(dtype)
    assert pack_linear_weights(model, CPU, dtype) == 3
    # Each packed buffer whole (at least the weight's bytes), and the same outputs, bit for
    # bit, as weights that stayed where oneDNN put them.
    assert len(handed) == 3
    for start, end in handed:
        assert end - start >= 2048 * 1024 * x.element_size()
    assert all(torch.equal(layer(x), want) for layer, want in zip(model, expected, strict=True))
