"""The start-up check of a 4-bit checkpoint's tensor-parallel shards (``int4_shard_check``)
agrees with what the layers hold: in activation order every rank keeps every group, so a
row-parallel projection's inputs per rank need only be whole packed words, and a refusal
names the layer, what the shard would cut and the sizes that fit."""

from __future__ import annotations

import pytest

from tandem.core.errors import ModelLoadError
from tandem.core.layers.quant_scheme import LINEAR_ATTENTION_PROJECTIONS, W4A16Scheme
from tandem.core.models.int4_shard_check import ShardedProjection, check_int4_shards

ACT_ORDER = W4A16Scheme(
    group_size=64, sym=True, desc_act=True, quantized=frozenset(LINEAR_ATTENTION_PROJECTIONS)
)
OUT_PROJ = "linear_attn.out_proj"


def test_activation_order_shards_may_hold_part_of_a_group() -> None:
    check_int4_shards(ACT_ORDER, [ShardedProjection(3, OUT_PROJ, split_inputs=192)], ranks=2)


def test_a_shard_that_cuts_a_packed_word_is_refused_naming_the_layer() -> None:
    """24 inputs over two ranks: 12 each, a word and a half."""
    with pytest.raises(ModelLoadError) as caught:
        check_int4_shards(ACT_ORDER, [ShardedProjection(3, OUT_PROJ, split_inputs=24)], ranks=2)
    message = str(caught.value)
    assert message.startswith(f"model.layers.3.{OUT_PROJ}: its 24 inputs over 2")
    assert "a packed word of 8 inputs" in message
    assert message.endswith("tensor-parallel sizes that keep whole packed words: 1")
