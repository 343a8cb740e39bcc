"""Gated DeltaNet's b and a: computed by ``in_proj_qkvz`` (sections q, k, v, z, b, a) where
both checkpoint pairs are stored alike, else apart by ``in_proj_ba``. Loaded from the same
checkpoint tensors, the fused layer computes what the separate one does (packed on CPU too,
where its weight, off the kernel's panels, is padded with zero rows); at each rank of TP=2 its
rows are that rank's slice of each section, and the conv weight still q, k and v's."""

from __future__ import annotations

import pytest
import torch

from tandem.collectives import SingleRankGroup
from tandem.core.kernels.attention_metadata import AttentionMetadata
from tandem.core.kernels.cpu.packed_linear import native_kernel, pack_linear_weights
from tandem.core.kernels.linear_attention_metadata import build_linear_attention_metadata
from tandem.core.layers.gated_delta_net import GatedDeltaNet, gates_fused
from tandem.core.layers.quant_scheme import W4A16Scheme, W8A8Scheme

from ..conftest import HeldTensor

HIDDEN, K = 32, 4
KEY_HEADS, VALUE_HEADS, HEAD_DIM = 2, 4, 8
KEY, VALUE = KEY_HEADS * HEAD_DIM, VALUE_HEADS * HEAD_DIM
CPU = torch.device("cpu")


class _Rank:
    """Rank ``rank`` of ``size``: all that building and loading a layer asks of its group."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


def _checkpoint(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    return {
        "in_proj_qkv": normal(2 * KEY + VALUE, HIDDEN),
        "in_proj_z": normal(VALUE, HIDDEN),
        "in_proj_b": normal(VALUE_HEADS, HIDDEN),
        "in_proj_a": normal(VALUE_HEADS, HIDDEN),
        "conv1d": normal(2 * KEY + VALUE, 1, K),
        "A_log": normal(VALUE_HEADS),
        "dt_bias": normal(VALUE_HEADS),
        "norm": 1 + normal(HEAD_DIM),
        "out_proj": normal(HIDDEN, VALUE),
    }


def _layer(fuse: bool, group: object = None) -> GatedDeltaNet:
    return GatedDeltaNet(
        HIDDEN,
        num_k_heads=KEY_HEADS,
        num_v_heads=VALUE_HEADS,
        k_head_dim=HEAD_DIM,
        v_head_dim=HEAD_DIM,
        conv_kernel_size=K,
        activation="silu",
        eps=1e-6,
        group=group or SingleRankGroup(),  # type: ignore[arg-type]
        fuse_gates=fuse,
    )


def _load_projections(layer: GatedDeltaNet, checkpoint: dict[str, torch.Tensor]) -> None:
    """The input projections and conv taps, as the model loader hands them over."""
    gates = layer.in_proj_qkvz if layer.in_proj_ba is None else layer.in_proj_ba
    for name, owner in [
        ("in_proj_qkv", layer.in_proj_qkvz),
        ("in_proj_z", layer.in_proj_qkvz),
        ("in_proj_b", gates),
        ("in_proj_a", gates),
    ]:
        owner.load_shard(owner.weight, HeldTensor(checkpoint[name]), name, name)
    conv = layer.conv1d
    conv.load_weight(conv.weight, HeldTensor(checkpoint["conv1d"]), "conv1d.weight")


def _loaded(fuse: bool, checkpoint: dict[str, torch.Tensor], rows: int) -> GatedDeltaNet:
    layer = _layer(fuse)
    _load_projections(layer, checkpoint)
    with torch.no_grad():
        layer.A_log.copy_(checkpoint["A_log"])
        layer.dt_bias.copy_(checkpoint["dt_bias"])
        layer.norm.weight.copy_(checkpoint["norm"])
        layer.out_proj.weight.copy_(checkpoint["out_proj"])
    gen = torch.Generator().manual_seed(7)
    layer.bind_state(
        torch.randn(layer.conv_state_shape(rows), generator=gen),
        torch.randn(layer.recurrent_state_shape(rows), generator=gen) * 0.1,
    )
    return layer


def _step(layer: GatedDeltaNet, x: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """One step: a decode (slot 1, state from before), then a fresh prefill (slot 2)."""
    query_lens = torch.tensor(lens)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0), num_decode_tokens=1, decode=None, prefill=None
    )
    meta.linear = build_linear_attention_metadata(
        query_lens,
        query_lens + torch.tensor([40, 0]),
        torch.tensor([1, 2]),
        num_decodes=1,
        conv_kernel_size=K,
        device=CPU,
    )
    with torch.no_grad():
        out: torch.Tensor = layer(x, meta)
    return out


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_b_and_a_computed_in_in_proj_qkvz_equal_them_apart(packed: bool) -> None:
    checkpoint = _checkpoint(seed=1)
    fused, apart = _loaded(True, checkpoint, rows=4), _loaded(False, checkpoint, rows=4)
    assert fused.in_proj_ba is None and apart.in_proj_ba is not None
    if packed:
        pack_linear_weights(fused, CPU, torch.float32)
        pack_linear_weights(apart, CPU, torch.float32)
    lens = [1, 6]
    x = torch.randn(sum(lens), HIDDEN, generator=torch.Generator().manual_seed(2))
    out_fused, out_apart = _step(fused, x, lens), _step(apart, x, lens)
    # float32, the same products summed in another order (the fused matmul may block its
    # columns otherwise; packed, b and a come from our kernel instead of oneDNN): each
    # projected value moves by at most HIDDEN = 32 roundings of 2^-24 of the sum of its
    # terms' magnitudes, ~2e-6 relative. The conv, the gates, 6 steps of the delta rule, the
    # gated norm and out_proj are each Lipschitz with constants of a few units at these
    # weight scales (std 0.3, state 0.1), so the outputs move by well under 1e-4 of their
    # size; b and a swapped, or any section off by a column, moves them by their own size.
    scale = out_apart.abs().max().item()
    assert (out_fused - out_apart).abs().max().item() <= 1e-4 * scale
    assert torch.allclose(fused.recurrent_state, apart.recurrent_state, rtol=0, atol=1e-4)


def test_the_fused_weight_off_the_kernels_panels_is_padded_and_read_by_it() -> None:
    kernel = native_kernel(torch.float32)
    if kernel is None:
        pytest.skip("no native float32 kernel on this CPU (oneDNN computes every layer)")
    fused = _loaded(True, _checkpoint(seed=3), rows=4)
    outputs = 2 * KEY + 2 * VALUE + 2 * VALUE_HEADS  # 104: off every kernel's panels
    assert not kernel.readable(outputs, HIDDEN)
    pack_linear_weights(fused, CPU, torch.float32)
    projection = fused.in_proj_qkvz
    assert projection.native is not None
    assert projection.native.out_features == outputs + projection.padded_outputs
    x = torch.randn(3, HIDDEN)
    assert projection(x).shape == (3, outputs)


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_holds_its_slice_of_every_section(rank: int) -> None:
    checkpoint = _checkpoint(seed=4)
    layer = _layer(True, _Rank(rank, 2))
    _load_projections(layer, checkpoint)

    def mine(tensor: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        return [part.chunk(2)[rank] for part in torch.split(tensor, sizes)]

    qkv = mine(checkpoint["in_proj_qkv"], [KEY, KEY, VALUE])
    expected = torch.cat(
        [
            *qkv,
            *mine(checkpoint["in_proj_z"], [VALUE]),
            *mine(checkpoint["in_proj_b"], [VALUE_HEADS]),
            *mine(checkpoint["in_proj_a"], [VALUE_HEADS]),
        ]
    )
    assert torch.equal(layer.in_proj_qkvz.weight, expected)
    conv = torch.cat(mine(checkpoint["conv1d"].squeeze(1), [KEY, KEY, VALUE]))
    assert torch.equal(layer.conv1d.weight, conv)


def test_b_and_a_are_fused_only_where_both_pairs_are_stored_alike() -> None:
    assert gates_fused(None)
    assert gates_fused(W8A8Scheme(static=False))
    # Static: the fused input scale would be the maximum over all four tensors.
    assert not gates_fused(W8A8Scheme(static=True))
    float_gates = frozenset({"linear_attn.in_proj_b", "linear_attn.in_proj_a"})
    assert not gates_fused(W8A8Scheme(static=False, float_projections=float_gates))
    every = frozenset({"linear_attn.in_proj_qkv", "linear_attn.in_proj_b"})
    assert gates_fused(W4A16Scheme(group_size=32, sym=True, desc_act=False, quantized=every))
    # In activation order: qkv's and b's g_idx would have to be one.
    assert not gates_fused(W4A16Scheme(group_size=32, sym=True, desc_act=True, quantized=every))
    qkv_only = frozenset({"linear_attn.in_proj_qkv"})
    assert not gates_fused(W4A16Scheme(group_size=32, sym=True, desc_act=False, quantized=qkv_only))
