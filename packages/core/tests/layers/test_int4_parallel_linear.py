"""The 4-bit (GPTQ) parallel linear layers: each rank cuts its shard of the packed codes, zero
points and scales (and, in activation order, of g_idx) so that its weight, as the kernel
dequantizes it, is exactly its rows or columns of the unsharded layer's; shards that would cut
a packed word or a group are refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tandem.core.kernels.reference.int4_linear import dequantize_int4
from tandem.core.layers.int4_weights import Int4Parameters
from tandem.core.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tandem.core.layers.quant_scheme import W4A16Scheme
from tandem.core.layers.quantized_linear import QuantizableLinear
from tandem.core.models.w4a16_writer import gptq_tensors

from ..conftest import HeldTensor
from .shard_helpers import load_tensors, rank_of


def _checkpoint(
    rows: int, cols: int, group: int, seed: int, act_order: bool = False
) -> dict[str, torch.Tensor]:
    """GPTQ tensors (asymmetric) of a random weight; in activation order, with a shuffled
    g_idx (the codes then belong to other groups than they were made for, which changes
    nothing for sharding)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = gptq_tensors("weight", torch.randn(rows, cols, generator=gen), group, sym=False)
    if act_order:
        tensors["g_idx"] = tensors["g_idx"][torch.randperm(cols, generator=gen)]
    return tensors


def _load(layer: QuantizableLinear, tensors: dict[str, torch.Tensor], shard: object = None) -> None:
    """Load ``tensors`` (as part ``shard`` of a fused layer), then pack them."""
    load_tensors(layer, tensors, shard)
    layer.finish_loading("layer")


def _param(layer: QuantizableLinear, name: str) -> nn.Parameter:
    return dict(layer.named_parameters())[name]


def _weight(layer: QuantizableLinear) -> torch.Tensor:
    """The layer's weight [out, in] as its kernel dequantizes it, in the inputs' own order."""
    w = layer.int4
    assert w is not None
    packed = dequantize_int4(w.qweight, w.scales, w.qzeros, w.kernel_g_idx(), torch.float64)
    order = w.input_order()
    if order is None:
        return packed
    natural = torch.empty_like(packed)
    natural[:, order] = packed
    return natural


def _scheme(group: int, act_order: bool = False) -> W4A16Scheme:
    return W4A16Scheme(group_size=group, sym=False, desc_act=act_order)


@pytest.mark.parametrize("group", [16, -1])
def test_column_shards_are_the_unsharded_rows(group: int) -> None:
    tensors = _checkpoint(32, 64, group, seed=0)
    whole = ColumnParallelLinear(64, 32, False, rank_of(0, 1), _scheme(group))
    _load(whole, tensors)
    for rank in range(2):
        layer = ColumnParallelLinear(64, 32, False, rank_of(rank, 2), _scheme(group))
        _load(layer, tensors)
        assert torch.equal(_weight(layer), _weight(whole)[rank * 16 : rank * 16 + 16])


@pytest.mark.parametrize("act_order", [False, True], ids=["groups", "act order"])
def test_row_shards_are_the_unsharded_columns(act_order: bool) -> None:
    tensors = _checkpoint(24, 64, 16, seed=1, act_order=act_order)
    scheme = _scheme(16, act_order)
    whole = RowParallelLinear(64, 24, False, rank_of(0, 1), quant=scheme)
    _load(whole, tensors)
    for rank in range(2):
        layer = RowParallelLinear(64, 24, False, rank_of(rank, 2), quant=scheme)
        _load(layer, tensors)
        assert layer.int4 is not None
        # Activation order: every rank keeps all 4 groups; else its own 2.
        assert layer.int4.scales.shape == (24, 4 if act_order else 2)
        assert torch.equal(_weight(layer), _weight(whole)[:, rank * 32 : rank * 32 + 32])


def test_activation_order_shards_need_not_be_whole_groups() -> None:
    """192 inputs in groups of 64 over two ranks: 96 each, a group and a half. Every rank
    keeps all the groups, so its inputs may be any of them (vLLM refuses this size)."""
    tensors = _checkpoint(24, 192, 64, seed=9, act_order=True)
    scheme = _scheme(64, act_order=True)
    whole = RowParallelLinear(192, 24, False, rank_of(0, 1), quant=scheme)
    _load(whole, tensors)
    x = torch.randn(5, 192, generator=torch.Generator().manual_seed(10))
    total = torch.zeros(5, 24, dtype=torch.float64)
    for rank in range(2):
        layer = RowParallelLinear(192, 24, False, rank_of(rank, 2), quant=scheme)
        _load(layer, tensors)
        assert layer.int4 is not None and layer.int4.scales.shape == (24, 3)
        columns = slice(rank * 96, rank * 96 + 96)
        assert torch.equal(_weight(layer), _weight(whole)[:, columns])
        total += layer.partial(x[:, columns]).double()
    torch.testing.assert_close(total, x.double() @ _weight(whole).t(), rtol=1e-5, atol=1e-5)


def test_fused_parts_land_in_their_places() -> None:
    gate, up = _checkpoint(16, 32, 16, seed=2), _checkpoint(16, 32, 16, seed=3)
    whole = {}
    for name, part in (("gate", gate), ("up", up)):
        layer = ColumnParallelLinear(32, 16, False, rank_of(0, 1), _scheme(16))
        _load(layer, part)
        whole[name] = _weight(layer)
    for rank in range(2):
        fused = MergedColumnParallelLinear(32, [16, 16], False, rank_of(rank, 2), _scheme(16))
        load_tensors(fused, gate, shard=0)
        _load(fused, up, shard=1)
        rows = slice(rank * 8, rank * 8 + 8)
        expected = torch.cat([whole["gate"][rows], whole["up"][rows]])
        assert torch.equal(_weight(fused), expected)


def test_a_part_that_cuts_a_packed_word_is_refused() -> None:
    """Head size 4: a rank's k part (one head, 4 outputs) is half an int32 word of zeros."""
    layer = QKVParallelLinear(32, 4, 4, 2, False, rank_of(1, 2), quant=_scheme(16))
    k = _checkpoint(8, 32, 16, seed=4)
    with pytest.raises(ValueError, match="whole packed words of 8"):
        layer.load_shard(_param(layer, "qzeros"), HeldTensor(k["qzeros"]), "k", "k_proj.qzeros")


def test_fused_parts_with_different_groups_are_refused() -> None:
    q = _checkpoint(16, 32, 16, seed=5, act_order=True)
    k = _checkpoint(8, 32, 16, seed=6, act_order=True)
    layer = QKVParallelLinear(32, 8, 2, 1, False, rank_of(0, 1), quant=_scheme(16, True))
    g_idx = _param(layer, "g_idx")
    layer.load_shard(g_idx, HeldTensor(q["g_idx"]), "q", "q_proj.g_idx")
    with pytest.raises(ValueError, match="must share g_idx"):
        layer.load_shard(g_idx, HeldTensor(k["g_idx"]), "k", "k_proj.g_idx")


def test_a_float_tensor_for_packed_codes_is_refused() -> None:
    layer = ColumnParallelLinear(32, 16, False, rank_of(0, 1), _scheme(16))
    with pytest.raises(ValueError, match="quantization_config does not match"):
        layer.load_weight(_param(layer, "qweight"), HeldTensor(torch.zeros(4, 16)), "x.qweight")


def test_activation_order_runs_as_consecutive_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole layer in activation order has its inputs sorted by group at load, so the
    kernels that read consecutive groups serve it: the same weight, columns in the sorted
    order, with each call's activations gathered the same way."""
    tensors = _checkpoint(24, 64, 16, seed=7, act_order=True)
    scheme = _scheme(16, act_order=True)
    layer = RowParallelLinear(64, 24, False, rank_of(0, 1), quant=scheme)
    _load(layer, tensors)
    with monkeypatch.context() as patch:
        patch.setattr(Int4Parameters, "_order_inputs_by_group", lambda self: None)
        kept = RowParallelLinear(64, 24, False, rank_of(0, 1), quant=scheme)
        _load(kept, tensors)
    w, k = layer.int4, kept.int4
    assert w is not None and k is not None
    assert w.kernel_g_idx() is None and w.input_order() is not None
    assert k.kernel_g_idx() is not None and k.input_order() is None
    assert torch.equal(_weight(layer), _weight(kept))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(8))
    expected = x.double() @ _weight(kept).t()
    torch.testing.assert_close(layer.matmul(x).double(), expected, rtol=1e-5, atol=1e-5)
