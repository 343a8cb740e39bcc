"""The int8 (W8A8) parallel linear layers: each rank loads its shard of the int8 weight with
the matching per-channel scales, fused projections concatenate their scales in the order of
their rows, and every shard computes exactly the rows the unsharded layer does."""

from __future__ import annotations

import pytest
import torch

from tandem.core.kernels.reference.int8_linear import int8_linear
from tandem.core.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tandem.core.layers.quant_scheme import W8A8Scheme

from .shard_helpers import load_tensors, rank_of

DYNAMIC, STATIC = W8A8Scheme(static=False), W8A8Scheme(static=True)


def _int8(rows: int, cols: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randint(-128, 128, (rows, cols), dtype=torch.int8, generator=gen)
    return w, torch.rand(rows, 1, generator=gen) + 0.1


def test_column_shards_carry_their_rows_scales() -> None:
    gen = torch.Generator().manual_seed(0)
    w, ws = _int8(8, 16, gen)
    x = torch.randn(3, 16, generator=gen)
    whole = int8_linear(x, w, ws, None, None)
    outs = []
    for rank in range(2):
        layer = ColumnParallelLinear(16, 8, False, rank_of(rank, 2), DYNAMIC)
        load_tensors(layer, {"weight": w, "weight_scale": ws})
        assert layer.weight.dtype is torch.int8 and layer.weight_scale is not None
        assert torch.equal(layer.weight_scale, ws[rank * 4 : rank * 4 + 4])
        outs.append(layer(x))
    assert torch.equal(torch.cat(outs, dim=-1), whole)


def test_row_shards_split_the_weight_and_keep_every_scale() -> None:
    gen = torch.Generator().manual_seed(1)
    w, ws = _int8(6, 8, gen)
    for rank in range(2):
        layer = RowParallelLinear(8, 6, False, rank_of(rank, 2), quant=STATIC)
        load_tensors(layer, {"weight": w, "weight_scale": ws, "input_scale": torch.tensor([0.25])})
        assert torch.equal(layer.weight, w[:, rank * 4 : rank * 4 + 4])
        assert torch.equal(layer.weight_scale, ws)  # type: ignore[arg-type]
        assert layer.input_scale is not None and layer.input_scale.tolist() == [0.25]


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_gate_up_concatenates_scales_like_the_weights(tp: int) -> None:
    gen = torch.Generator().manual_seed(2)
    gate, up = _int8(8, 16, gen), _int8(8, 16, gen)
    x = torch.randn(5, 16, generator=gen)
    for rank in range(tp):
        layer = MergedColumnParallelLinear(16, [8, 8], False, rank_of(rank, tp), DYNAMIC)
        for shard, (w, ws) in enumerate((gate, up)):
            load_tensors(layer, {"weight": w, "weight_scale": ws}, shard)
        rows = slice(rank * 8 // tp, (rank + 1) * 8 // tp)
        expected = [int8_linear(x, w[rows], ws[rows], None, None) for w, ws in (gate, up)]
        assert torch.equal(layer(x), torch.cat(expected, dim=-1))


def test_fused_qkv_takes_the_largest_static_input_scale() -> None:
    gen = torch.Generator().manual_seed(3)
    # 4 query heads, 2 KV heads of 4: q 16 rows, k and v 8 each.
    parts = {name: _int8(rows, 16, gen) for name, rows in (("q", 16), ("k", 8), ("v", 8))}
    scales = {"q": 0.02, "k": 0.05, "v": 0.03}
    x = torch.randn(4, 16, generator=gen)
    for rank in range(2):
        layer = QKVParallelLinear(16, 4, 4, 2, False, rank_of(rank, 2), quant=STATIC)
        for name, (w, ws) in parts.items():
            tensors = {"weight": w, "weight_scale": ws, "input_scale": torch.tensor([scales[name]])}
            load_tensors(layer, tensors, name)
        expected = []
        for w, ws in parts.values():
            rows = w.shape[0] // 2
            part = slice(rank * rows, (rank + 1) * rows)
            expected.append(int8_linear(x, w[part], ws[part], torch.tensor(0.05), None))
        assert torch.equal(layer(x), torch.cat(expected, dim=-1))


def test_a_float_tensor_for_an_int8_weight_is_refused() -> None:
    layer = ColumnParallelLinear(4, 4, False, rank_of(0, 1), DYNAMIC)
    with pytest.raises(ValueError, match="quantization_config does not match"):
        load_tensors(layer, {"weight": torch.randn(4, 4)})
    plain = ColumnParallelLinear(4, 4, False, rank_of(0, 1))
    assert plain.weight_scale is None and plain.input_scale is None
    with pytest.raises(ValueError, match=r"is torch\.int8"):
        load_tensors(plain, {"weight": torch.zeros(4, 4, dtype=torch.int8)})
