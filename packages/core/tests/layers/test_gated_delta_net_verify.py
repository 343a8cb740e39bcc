"""Speculative verification through a Gated DeltaNet layer: a verifying sequence's tokens run a
position at a time, and its state after each position but the last lands in a scratch row.
Against the same tokens run one decode step at a time: the outputs, each kept state and the
final state are the same, beside a plain decode and a fresh prefill in the same step."""

from __future__ import annotations

import pytest
import torch

from tandem.collectives import SingleRankGroup
from tandem.core.kernels.attention_metadata import AttentionMetadata
from tandem.core.kernels.linear_attention_metadata import build_linear_attention_metadata
from tandem.core.layers.gated_delta_net import GatedDeltaNet

HIDDEN, K = 32, 4
CPU = torch.device("cpu")


def _layer(seed: int) -> GatedDeltaNet:
    torch.manual_seed(seed)
    layer = GatedDeltaNet(
        HIDDEN,
        num_k_heads=2,
        num_v_heads=4,
        k_head_dim=8,
        v_head_dim=8,
        conv_kernel_size=K,
        activation="silu",
        eps=1e-6,
        group=SingleRankGroup(),
    )
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    rows = 16
    layer.bind_state(
        torch.randn(layer.conv_state_shape(rows)), torch.randn(layer.recurrent_state_shape(rows))
    )
    return layer


def _run(
    layer: GatedDeltaNet,
    x: torch.Tensor,
    lens: list[int],
    slots: list[int],
    fresh: list[bool],
    num_decodes: int,
    num_verifies: int = 0,
    scratch: list[int] | None = None,
) -> torch.Tensor:
    query_lens = torch.tensor(lens)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0), num_decode_tokens=num_decodes, decode=None, prefill=None
    )
    meta.linear = build_linear_attention_metadata(
        query_lens,
        query_lens + torch.tensor([0 if f else 50 for f in fresh]),
        torch.tensor(slots),
        num_decodes=num_decodes,
        conv_kernel_size=K,
        device=CPU,
        num_verifies=num_verifies,
        verify_scratch=None if scratch is None else torch.tensor(scratch),
    )
    with torch.no_grad():
        out: torch.Tensor = layer(x, meta)
    return out


@pytest.mark.parametrize("verify_lens", [[3, 2, 5], [2], [4, 4]])
def test_verify_positions_equal_decode_steps_and_keep_each_state(verify_lens: list[int]) -> None:
    layer = _layer(seed=len(verify_lens))
    reference = _layer(seed=len(verify_lens))
    gen = torch.Generator().manual_seed(3)
    verify_slots = [2 + i for i in range(len(verify_lens))]
    prefill_slot = 2 + len(verify_lens)
    lens = [1, *verify_lens, 5]
    x = torch.randn(sum(lens), HIDDEN, generator=gen)
    scratch_rows = list(range(10, 10 + sum(n - 1 for n in verify_lens)))
    got = _run(
        layer,
        x,
        lens,
        [1, *verify_slots, prefill_slot],
        [False, *[False] * len(verify_lens), True],
        num_decodes=1,
        num_verifies=len(verify_lens),
        scratch=scratch_rows,
    )

    # The reference: the decode, then each verifying token as a decode step of its own
    # (its state after each position read off the slot), then the prefill.
    want = torch.empty_like(got)
    want[:1] = _run(reference, x[:1], [1], [1], [False], num_decodes=1)
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    start = 1
    for slot, n in zip(verify_slots, verify_lens, strict=True):
        for j in range(n):
            t = start + j
            want[t : t + 1] = _run(reference, x[t : t + 1], [1], [slot], [False], num_decodes=1)
            if j < n - 1:
                kept.append(
                    (reference.conv_state[slot].clone(), reference.recurrent_state[slot].clone())
                )
        start += n
    want[start:] = _run(reference, x[start:], [5], [prefill_slot], [True], num_decodes=0)

    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for row, (conv, recurrent) in zip(scratch_rows, kept, strict=True):
        torch.testing.assert_close(layer.conv_state[row], conv, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.recurrent_state[row], recurrent, rtol=1e-5, atol=1e-5)
    # Every slot ends where token-by-token decoding leaves it; untouched rows stay as they were
    # (tolerances: the in-projection of a batch and of one row round apart).
    for slot in [1, *verify_slots, prefill_slot]:
        torch.testing.assert_close(layer.recurrent_state[slot], reference.recurrent_state[slot])
        torch.testing.assert_close(layer.conv_state[slot], reference.conv_state[slot])
    others = [r for r in range(17) if r not in scratch_rows]
    torch.testing.assert_close(layer.recurrent_state[others], reference.recurrent_state[others])


def test_scratch_rows_must_match_the_kept_states() -> None:
    layer = _layer(seed=0)
    with pytest.raises(ValueError, match="keep 4 states"):
        _run(layer, torch.randn(6, HIDDEN), [2, 4], [1, 2], [False, False], 0, 2, [10, 11])
