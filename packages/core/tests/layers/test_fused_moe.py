"""The sparse MoE block against transformers' (Qwen3-MoE without, Qwen3.5-MoE with a shared
expert) in float32, loaded from per-expert and from fused checkpoint names, and split over two
tensor-parallel ranks (in-process, one thread each) with the same output; on packed experts,
its one native call against routing and then the experts' forward."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import transformers
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as ref35
from transformers.models.qwen3_moe import modeling_qwen3_moe as ref3

from tandem.collectives import ProcessGroup, SingleRankGroup, create_inprocess_groups
from tandem.core.kernels.cpu.grouped_moe import grouped_expert_kernel
from tandem.core.kernels.cpu.moe_routing import NativeMoeRouting, native_moe_routing
from tandem.core.kernels.cpu.packed_linear import (
    native_kernel,
    pack_linear_weights,
    packing_enabled,
)
from tandem.core.kernels.reference.fused_moe import fused_moe
from tandem.core.layers.fused_moe import FusedMoeExperts, pack_expert_weights
from tandem.core.layers.sparse_moe_block import SparseMoeBlock

from ..conftest import HeldTensor

HIDDEN, EXPERTS, TOP_K, INTER, SHARED = 32, 8, 2, 16, 24


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread() -> Iterator[None]:
    """These tensors are tiny: on a busy machine waking a second OpenMP thread costs more than
    the work (a depthwise conv1d of 4 steps: 25 ms with two threads, 0.2 ms with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _reference(shared: bool, normalize: bool) -> Any:
    torch.manual_seed(0)
    block: Any
    if shared:
        block_cls: Any = ref35.Qwen3_5MoeSparseMoeBlock
        block = block_cls(
            transformers.Qwen3_5MoeTextConfig(
                hidden_size=HIDDEN,
                num_experts=EXPERTS,
                num_experts_per_tok=TOP_K,
                moe_intermediate_size=INTER,
                shared_expert_intermediate_size=SHARED,
            )
        )
    else:
        block = ref3.Qwen3MoeSparseMoeBlock(
            transformers.Qwen3MoeConfig(
                hidden_size=HIDDEN,
                num_experts=EXPERTS,
                num_experts_per_tok=TOP_K,
                moe_intermediate_size=INTER,
                norm_topk_prob=normalize,
            )
        )
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(std=0.3)
    return block.eval()


def _checkpoint(block: Any, fused: bool) -> dict[str, torch.Tensor]:
    """The block's tensors under checkpoint names (relative to ``mlp.``)."""
    tensors = {"gate.weight": block.gate.weight.detach()}
    gate_up, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    if fused:
        tensors["experts.gate_up_proj"] = gate_up
        tensors["experts.down_proj"] = down
    else:
        for e in range(EXPERTS):
            tensors[f"experts.{e}.gate_proj.weight"] = gate_up[e, :INTER]
            tensors[f"experts.{e}.up_proj.weight"] = gate_up[e, INTER:]
            tensors[f"experts.{e}.down_proj.weight"] = down[e]
    if getattr(block, "shared_expert", None) is not None:
        for part in ("gate_proj", "up_proj", "down_proj"):
            tensors[f"shared_expert.{part}.weight"] = getattr(block.shared_expert, part).weight
        tensors["shared_expert_gate.weight"] = block.shared_expert_gate.weight
    return {name: t.detach() for name, t in tensors.items()}


def _ours(
    tensors: dict[str, torch.Tensor], shared: bool, normalize: bool, group: ProcessGroup
) -> SparseMoeBlock:
    block = SparseMoeBlock(
        HIDDEN,
        num_experts=EXPERTS,
        top_k=TOP_K,
        intermediate_size=INTER,
        normalize_topk=normalize,
        shared_intermediate_size=SHARED if shared else 0,
        activation="silu",
        group=group,
    )
    params = dict(block.named_parameters())
    for name, tensor in tensors.items():
        lazy = HeldTensor(tensor)
        if name.startswith("experts."):
            block.experts.load_checkpoint_tensor(name.removeprefix("experts."), lazy, name)
        elif name.startswith("shared_expert."):
            assert block.shared_expert is not None
            part = name.split(".")[1]
            if part == "down_proj":
                down = block.shared_expert.down_proj
                down.load_weight(down.weight, lazy, name)
            else:
                merged = block.shared_expert.gate_up_proj
                merged.load_shard(merged.weight, lazy, 0 if part == "gate_proj" else 1, name)
        else:
            owner = block.get_submodule(name.rsplit(".", 1)[0])
            owner.load_weight(params[name], lazy, name)  # type: ignore[operator]
    assert block.experts.fully_loaded()
    return block


CASES = {
    "qwen3-moe-unnormalised": (False, False),
    "qwen3-moe-normalised": (False, True),
    "qwen3.5-moe-shared-expert": (True, True),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
def test_moe_block_matches_transformers(case: str, fused: bool) -> None:
    shared, normalize = CASES[case]
    reference = _reference(shared, normalize)
    block = _ours(_checkpoint(reference, fused), shared, normalize, SingleRankGroup())
    x = torch.randn(37, HIDDEN)
    with torch.no_grad():
        expected = reference(x.unsqueeze(0))[0]
        got = block(x)
    assert (got - expected).abs().max().item() <= 1e-5
    assert expected.abs().max().item() > 0.1  # a real signal, not two zeros


def test_grouped_kernel_adds_each_tokens_experts_by_weight() -> None:
    # One token per expert pattern, checked by hand against dense per-token arithmetic.
    w13 = torch.randn(4, 6, 5)
    w2 = torch.randn(4, 5, 3)
    x = torch.randn(3, 5)
    ids = torch.tensor([[2, 0], [2, 3], [1, 2]])
    weights = torch.rand(3, 2)
    got = fused_moe(x, w13, w2, weights, ids, activation="silu")
    for t in range(3):
        expected = torch.zeros(5)
        for c in range(2):
            gate, up = (w13[ids[t, c]] @ x[t]).chunk(2)
            expected += weights[t, c] * (w2[ids[t, c]] @ (torch.nn.functional.silu(gate) * up))
        assert (got[t] - expected).abs().max().item() <= 1e-5


def test_moe_block_split_over_two_ranks_equals_one() -> None:
    reference = _reference(shared=True, normalize=True)
    tensors = _checkpoint(reference, fused=False)
    x = torch.randn(9, HIDDEN)
    with torch.no_grad():
        whole = _ours(tensors, True, True, SingleRankGroup())(x)
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def rank(group: ProcessGroup) -> None:
        try:
            block = _ours(tensors, True, True, group)
            assert block.experts.w13.shape == (EXPERTS, INTER, HIDDEN)  # half of 2 * INTER
            with torch.no_grad():
                results[group.rank] = block(x)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)

    threads = [
        threading.Thread(target=rank, args=(g,)) for g in create_inprocess_groups(2, timeout_s=30)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert torch.equal(results[0], results[1])
    assert (results[0] - whole).abs().max().item() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_router_and_shared_gate_are_padded_onto_the_native_kernel(dtype: torch.dtype) -> None:
    """8 experts and a 1-output gate are off every native kernel's panels: left as they were,
    oneDNN ran them, at ~80 us a router call in a decode step. Padded with zero outputs, our
    kernel reads them and the block still gives the reference's result."""
    kernel = native_kernel(dtype) if packing_enabled(dtype) else None
    if kernel is None:
        pytest.skip(f"no native {dtype} linear kernel on this CPU or ISA level")
    reference = _reference(shared=True, normalize=True).to(dtype)
    block = _ours(_checkpoint(reference, fused=True), True, True, SingleRankGroup()).to(dtype)
    x = torch.randn(5, HIDDEN).to(dtype)
    with torch.no_grad():
        expected = block(x).float()
        pack_linear_weights(block, torch.device("cpu"), dtype)
        got = block(x).float()
    for layer, outputs in ((block.gate, EXPERTS), (block.shared_expert_gate, 1)):
        assert layer is not None and layer.native is not None
        assert layer.native.out_features == outputs + layer.padded_outputs > outputs
    # float32: the same products summed in another order; bfloat16: a routing weight or an
    # output one rounding apart (the experts chosen are the same: the logits are far apart).
    tolerance = 1e-5 if dtype is torch.float32 else 3e-2
    assert (got - expected).abs().max().item() <= tolerance * expected.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_experts_run_in_one_native_call_as_routed_then_forward(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a grouped kernel packs the experts, the block hands its router's logits (a view
    of the router padded onto the kernel's panels) to one native call
    (``NativeMoeRouting.block``): what the router's top-k and then the experts' forward give,
    bit for bit."""
    if grouped_expert_kernel(dtype) is None or native_moe_routing() is None:
        pytest.skip(f"no grouped expert kernel or routing library for {dtype} here")
    hidden, inter = 128, 128
    block = SparseMoeBlock(
        hidden,
        num_experts=EXPERTS,
        top_k=TOP_K,
        intermediate_size=inter,
        normalize_topk=True,
        shared_intermediate_size=0,
        activation="silu",
        group=SingleRankGroup(),
    )
    g = torch.Generator().manual_seed(4)
    for param in block.parameters():
        param.data = (torch.randn(param.shape, generator=g) * 0.1).to(dtype)
    cpu = torch.device("cpu")
    pack_linear_weights(block, cpu, dtype)
    assert pack_expert_weights(block, cpu, dtype) == 1
    assert block.gate.padded_outputs > 0  # the logits: a view of wider rows
    calls: list[int] = []
    real = NativeMoeRouting.block

    def spy(self: NativeMoeRouting, x: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(self, x, *args)

    monkeypatch.setattr(NativeMoeRouting, "block", spy)
    x = torch.randn(6, hidden, generator=g).to(dtype)
    with torch.no_grad():
        got = block(x)
    assert calls == [6]
    monkeypatch.setattr(FusedMoeExperts, "routed", lambda self, *args: None)
    with torch.no_grad():
        want = block(x)
    assert calls == [6]
    assert torch.equal(got, want)
