"""The linear-attention kernels against transformers' torch reference functions (float32):
the chunked gated delta rule over varlen batches, its one-step form, the causal conv1d (whole
sequence and one-step update), the gated and zero-centred RMSNorms; plus what the engine relies
on: prefill split over several calls carrying state equals one call, a varlen batch equals its
sequences one by one, a first chunk ignores whatever its slot held."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as ref

from tandem.collectives import SingleRankGroup
from tandem.core.kernels.attention_metadata import AttentionMetadata
from tandem.core.kernels.linear_attention_metadata import (
    LinearAttentionMetadata,
    build_linear_attention_metadata,
)
from tandem.core.kernels.reference.causal_conv1d import causal_conv1d_prefill, causal_conv1d_update
from tandem.core.kernels.reference.elementwise import rms_norm_gated, rms_norm_zero_centered
from tandem.core.kernels.reference.gated_delta_rule import (
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from tandem.core.layers.gated_delta_net import GatedDeltaNet
from tandem.device import Device, KernelKey, process_kernel_registry

CPU = torch.device("cpu")
HK, HV, DK, DV = 2, 4, 8, 16  # two value heads per key head (grouped value attention)
K = 4  # conv taps
TIGHT = 2e-5


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread() -> Iterator[None]:
    """These tensors are tiny: on a busy machine waking a second OpenMP thread costs more than
    the work (a depthwise conv1d of 4 steps: 25 ms with two threads, 0.2 ms with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _meta(
    lens: list[int],
    slots: list[int],
    fresh: list[bool],
    num_decodes: int = 0,
    chunk_size: int = 64,
) -> LinearAttentionMetadata:
    """Metadata for sequences with ``lens`` new tokens; ``fresh`` ones start from zero."""
    query_lens = torch.tensor(lens)
    context_lens = query_lens + torch.tensor([0 if f else 100 for f in fresh])
    return build_linear_attention_metadata(
        query_lens,
        context_lens,
        torch.tensor(slots),
        num_decodes=num_decodes,
        conv_kernel_size=K,
        device=CPU,
        chunk_size=chunk_size,
    )


class Delta(NamedTuple):
    """Inputs of the delta rule over N tokens."""

    q: torch.Tensor  # [N, HK, DK]
    k: torch.Tensor  # [N, HK, DK]
    v: torch.Tensor  # [N, HV, DV]
    g: torch.Tensor  # [N, HV] log decay
    beta: torch.Tensor  # [N, HV]

    def part(self, start: int, end: int) -> Delta:
        q, k, v, g, beta = (x[start:end] for x in self)
        return Delta(q, k, v, g, beta)

    @staticmethod
    def cat(parts: list[Delta]) -> Delta:
        q, k, v, g, beta = (torch.cat(xs) for xs in zip(*parts, strict=True))
        return Delta(q, k, v, g, beta)


def _delta_inputs(n: int, seed: int) -> Delta:
    gen = torch.Generator().manual_seed(seed)
    return Delta(
        q=torch.randn(n, HK, DK, generator=gen),
        k=torch.randn(n, HK, DK, generator=gen),
        v=torch.randn(n, HV, DV, generator=gen),
        g=-torch.rand(n, HV, generator=gen) * 3,  # some decays strong
        beta=torch.rand(n, HV, generator=gen),
    )


def _chunked(d: Delta, states: torch.Tensor, meta: LinearAttentionMetadata) -> torch.Tensor:
    return chunk_gated_delta_rule(d.q, d.k, d.v, d.g, d.beta, states, meta)


def _step(d: Delta, states: torch.Tensor, meta: LinearAttentionMetadata) -> torch.Tensor:
    return recurrent_gated_delta_rule(d.q, d.k, d.v, d.g, d.beta, states, meta)


def _reference_delta(
    d: Delta, initial: torch.Tensor | None, recurrent: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' chunked (or token by token) rule over one sequence."""
    fn: Any = (
        ref.torch_recurrent_gated_delta_rule if recurrent else ref.torch_chunk_gated_delta_rule
    )
    out, state = fn(
        d.q.unsqueeze(0),
        d.k.unsqueeze(0),
        d.v.unsqueeze(0),
        g=d.g.unsqueeze(0),
        beta=d.beta.unsqueeze(0),
        initial_state=None if initial is None else initial.unsqueeze(0),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return out[0], state[0]


def _bounds(lens: list[int]) -> list[tuple[int, int]]:
    return list(itertools.pairwise([0, *itertools.accumulate(lens)]))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("chunk_size", [64, 16])
def test_chunked_delta_rule_varlen_matches_the_reference(chunk_size: int) -> None:
    lens = [5, 70, 130, 1]
    fresh = [True, False, True, False]
    slots = [3, 1, 4, 6]
    inputs = _delta_inputs(sum(lens), seed=1)
    states = torch.randn(8, HV, DK, DV)
    initial = states.clone()
    states[3] = float("nan")  # a fresh sequence must not read its slot
    out = _chunked(inputs, states, _meta(lens, slots, fresh, chunk_size=chunk_size))
    for (a, b), slot, new in zip(_bounds(lens), slots, fresh, strict=True):
        expected, final = _reference_delta(inputs.part(a, b), None if new else initial[slot])
        assert _max_diff(out[a:b], expected) <= TIGHT
        assert _max_diff(states[slot], final) <= TIGHT
    untouched = [s for s in range(8) if s not in slots]
    assert torch.equal(states[untouched], initial[untouched])


def test_prefill_split_over_calls_carries_the_state() -> None:
    """Three sequences prefilled in pieces of different sizes over four calls (the state and
    output of each piece continuing the previous one) equal one call over whole sequences."""
    lens = [37, 90, 9]
    inputs = [_delta_inputs(n, seed=10 + i) for i, n in enumerate(lens)]
    slots = [2, 5, 1]
    whole_states = torch.zeros(6, HV, DK, DV)
    whole = _chunked(Delta.cat(inputs), whole_states, _meta(lens, slots, [True] * 3))
    pieces = [[3, 30, 4, 0], [64, 1, 20, 5], [9, 0, 0, 0]]
    states = torch.full((6, HV, DK, DV), float("nan"))
    done = [0, 0, 0]
    outs: list[list[torch.Tensor]] = [[], [], []]
    for call in range(4):
        seqs = [s for s in range(3) if pieces[s][call]]
        sizes = [pieces[s][call] for s in seqs]
        parts = [inputs[s].part(done[s], done[s] + pieces[s][call]) for s in seqs]
        meta = _meta(sizes, [slots[s] for s in seqs], [done[s] == 0 for s in seqs])
        out = _chunked(Delta.cat(parts), states, meta)
        for s, piece in zip(seqs, torch.split(out, sizes), strict=True):
            outs[s].append(piece)
            done[s] += pieces[s][call]
    assert _max_diff(torch.cat([torch.cat(o) for o in outs]), whole) <= TIGHT
    assert _max_diff(states[slots], whole_states[slots]) <= TIGHT


def test_varlen_batch_equals_each_sequence_alone() -> None:
    lens = [3, 64, 65, 20]
    inputs = _delta_inputs(sum(lens), seed=3)
    batch_states = torch.randn(5, HV, DK, DV)
    alone_states = batch_states.clone()
    fresh = [False, True, False, True]
    batch = _chunked(inputs, batch_states, _meta(lens, [1, 2, 3, 4], fresh))
    for i, (a, b) in enumerate(_bounds(lens)):
        alone = _chunked(inputs.part(a, b), alone_states, _meta([lens[i]], [i + 1], [fresh[i]]))
        assert _max_diff(batch[a:b], alone) <= TIGHT
    assert _max_diff(batch_states, alone_states) <= TIGHT


def test_recurrent_step_matches_the_reference_and_continues_a_prefill() -> None:
    # Decode steps over a sequence, one token each, carry on from where its prefill stopped,
    # and agree with the chunked form over the whole sequence.
    prompt, steps = 21, 6
    inputs = _delta_inputs(prompt + steps, seed=4)
    states = torch.zeros(3, HV, DK, DV)
    outs = [_chunked(inputs.part(0, prompt), states, _meta([prompt], [2], [True]))]
    for t in range(prompt, prompt + steps):
        before = states[2].clone()
        out = _step(inputs.part(t, t + 1), states, _meta([1], [2], [False], num_decodes=1))
        expected, final = _reference_delta(inputs.part(t, t + 1), before, recurrent=True)
        assert _max_diff(out, expected) <= TIGHT
        assert _max_diff(states[2], final) <= TIGHT
        outs.append(out)
    whole, whole_state = _reference_delta(inputs, None)
    assert _max_diff(torch.cat(outs), whole) <= 1e-4
    assert _max_diff(states[2], whole_state) <= 1e-4


def test_a_decode_without_initial_state_starts_from_zero() -> None:
    inputs = _delta_inputs(2, seed=5)
    states = torch.full((3, HV, DK, DV), float("nan"))
    out = _step(inputs, states, _meta([1, 1], [1, 2], [True, True], num_decodes=2))
    expected, _ = _reference_delta(inputs.part(0, 1), None)
    assert torch.isfinite(out).all() and torch.isfinite(states[1:]).all()
    assert _max_diff(out[:1], expected) <= TIGHT


def _reference_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """transformers' causal_conv1d_fn over [state | x] (the cache path), new tokens kept."""
    full = torch.cat((state, x.t()), dim=-1).unsqueeze(0)
    out: torch.Tensor = ref.causal_conv1d_fn(full, weight, bias=None, activation="silu")
    return out[0, :, -x.shape[0] :].t()


def test_causal_conv1d_varlen_with_initial_state_matches_the_reference() -> None:
    channels = 12
    lens = [1, 2, 9, 3]
    fresh = [False, True, False, False]
    slots = [4, 2, 1, 3]
    x = torch.randn(sum(lens), channels)
    weight = torch.randn(channels, K)
    pool = torch.randn(5, channels, K - 1)
    initial = pool.clone()
    pool[2] = float("nan")
    out = causal_conv1d_prefill(x, weight, pool, _meta(lens, slots, fresh), activation="silu")
    start = 0
    for n, slot, new in zip(lens, slots, fresh, strict=True):
        state = torch.zeros(channels, K - 1) if new else initial[slot]
        expected = _reference_conv(x[start : start + n], weight, state)
        assert (out[start : start + n] - expected).abs().max().item() <= 1e-6
        history = torch.cat((state, x[start : start + n].t()), dim=-1)[:, -(K - 1) :]
        assert torch.equal(pool[slot], history)
        start += n


def test_causal_conv1d_split_over_calls_and_update_equal_one_call() -> None:
    channels = 6
    x = torch.randn(17, channels)
    weight = torch.randn(channels, K)
    whole_pool = torch.zeros(2, channels, K - 1)
    whole = causal_conv1d_prefill(
        x, weight, whole_pool, _meta([17], [1], [True]), activation="silu"
    )
    pool = torch.full((2, channels, K - 1), float("nan"))
    outs = []
    done = 0
    for n in (2, 1, 7):
        outs.append(
            causal_conv1d_prefill(
                x[done : done + n], weight, pool, _meta([n], [1], [done == 0]), activation="silu"
            )
        )
        done += n
    while done < 17:  # the rest one token at a time, as decodes
        outs.append(
            causal_conv1d_update(
                x[done : done + 1],
                weight,
                pool,
                _meta([1], [1], [False], num_decodes=1),
                activation="silu",
            )
        )
        done += 1
    assert (torch.cat(outs) - whole).abs().max().item() <= 1e-6
    assert torch.equal(pool[1], whole_pool[1])


def test_causal_conv1d_update_matches_the_reference() -> None:
    channels = 8
    x = torch.randn(3, channels)
    weight = torch.randn(channels, K)
    pool = torch.randn(4, channels, K - 1)
    slots = [3, 1, 2]
    expected_state = pool[slots].clone()
    expected = ref.causal_conv1d_update(
        x.unsqueeze(-1), expected_state, weight, bias=None, activation="silu"
    )
    out = causal_conv1d_update(
        x, weight, pool, _meta([1, 1, 1], slots, [False] * 3, num_decodes=3), activation="silu"
    )
    assert (out - expected.squeeze(-1)).abs().max().item() <= 1e-6
    assert torch.equal(pool[slots], expected_state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_match_the_reference_modules(dtype: torch.dtype) -> None:
    x = torch.randn(10, 16, dtype=dtype)
    gate = torch.randn(10, 16, dtype=dtype)
    gated = ref.Qwen3_5RMSNormGated(16, eps=1e-6).to(dtype)
    centred = ref.Qwen3_5RMSNorm(16, eps=1e-6).to(dtype)
    with torch.no_grad():
        gated.weight.normal_()
        centred.weight.normal_(std=0.3)
        assert torch.equal(rms_norm_gated(x, gate, gated.weight, 1e-6), gated(x, gate))
        assert torch.equal(rms_norm_zero_centered(x, centred.weight, 1e-6), centred(x))


def test_the_linear_attention_kernels_resolve_through_the_process_registry() -> None:
    layer = GatedDeltaNet(
        32,
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
        torch.nn.init.normal_(p, std=0.2)
    layer.bind_state(
        torch.zeros(layer.conv_state_shape(2)), torch.zeros(layer.recurrent_state_shape(2))
    )
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0), num_decode_tokens=1, decode=None, prefill=None
    )
    meta.linear = _meta([1, 3], [1, 2], [True, True], num_decodes=1)
    out = layer(torch.randn(4, 32), meta)
    assert out.shape == (4, 32) and torch.isfinite(out).all()
    registry = process_kernel_registry()
    for name in (
        "causal_conv1d_prefill",
        "causal_conv1d_update",
        "chunk_gated_delta_rule",
        "recurrent_gated_delta_rule",
        "rms_norm_gated",
        "gdn_gating",
    ):
        assert registry.lookup(KernelKey(name, Device("cpu", 0), "torch.float32")) is not None
