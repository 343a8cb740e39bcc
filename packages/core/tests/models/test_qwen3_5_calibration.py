"""GPTQ calibration (``calibration.py``) of the Qwen3.5 family and Qwen3-MoE: statistics for
every projection the 4-bit scheme quantizes (the Gated DeltaNet's, the shared expert's and each
routed expert's too), equal to the inputs transformers' own model feeds those projections;
found by the writer whether the checkpoint keeps its layers under ``model.layers`` or a
composite's ``model.language_model.layers``; and what still falls back to round to nearest (a
projection without statistics, an expert no token was routed to) named in the log."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tandem.core.models.calibration import collect_hessians
from tandem.core.models.quantized_writer import PROJECTION_WEIGHT, layer_module
from tandem.core.models.w4a16_writer import write_w4a16

from ..conftest import HfFactory
from .checkpoint_files import read_tensors

SAMPLES = [[5, 17, 300, 42, 9, 100, 7, 250, 8, 61], [3, 9, 27, 81, 243, 11, 33, 99, 297, 2, 6]]
GROUP = 32
WRITER_LOG = "tandem.core.models.w4a16_writer"


def _reference_sums(model: Any) -> dict[str, torch.Tensor]:
    """Sum of x x^T of the inputs of each checkpoint projection of the transformers model,
    over ``SAMPLES``, keyed as ``collect_hessians`` keys them."""
    sums: dict[str, torch.Tensor] = {}

    def record(name: str, x: torch.Tensor) -> None:
        rows = x.reshape(-1, x.shape[-1]).double()
        sums[name] = sums.get(name, 0) + rows.t() @ rows

    def recorder(name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        key = layer_module(f"{name}.weight")
        return lambda module, args: record(key, args[0])

    def expert_recorder(name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        """The routed experts' inputs, recomputed from the router's choice transformers
        passes them: each expert's rows, and act(gate) * up of them."""
        key = layer_module(f"{name}.weight")

        def hook(experts: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x, top_k_index = args[0], args[1]
            gate_up_proj = experts.get_parameter("gate_up_proj")
            act = experts.get_submodule("act_fn")
            for e in range(gate_up_proj.shape[0]):
                rows = x[(top_k_index == e).any(-1)]
                if rows.shape[0]:
                    gate, up = (rows @ gate_up_proj[e].t()).chunk(2, dim=-1)
                    record(f"{key}.{e}.gate_proj", rows)
                    record(f"{key}.{e}.up_proj", rows)
                    record(f"{key}.{e}.down_proj", act(gate) * up)

        return hook

    hooks = [
        module.register_forward_pre_hook(recorder(name))
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and PROJECTION_WEIGHT.match(f"{name}.weight")
    ]
    hooks += [
        module.register_forward_pre_hook(expert_recorder(name))
        for name, module in model.named_modules()
        if name.endswith(".mlp.experts")
    ]
    with torch.no_grad():
        for sample in SAMPLES:
            model(input_ids=torch.tensor([sample]))
    for hook in hooks:
        hook.remove()
    return sums


@pytest.mark.parametrize(
    "architecture",
    [
        "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3MoeForCausalLM",
    ],
)
def test_statistics_are_the_inputs_of_every_projection(
    architecture: str, hf_model: HfFactory
) -> None:
    folder, model = hf_model(architecture)
    expected = _reference_sums(model)
    if architecture.startswith("Qwen3_5"):
        assert any(".linear_attn." in name for name in expected)
    if "Moe" in architecture:
        # Every expert's three projections, where some token was routed to it.
        routed = [name for name in expected if ".mlp.experts." in name]
        assert len(routed) >= 3 * 4 and len(routed) % 3 == 0
    got = collect_hessians(folder, SAMPLES)
    assert sorted(got) == sorted(expected)
    for name, total in expected.items():
        scale = float(total.abs().max())
        torch.testing.assert_close(got[name], total, rtol=1e-4, atol=1e-4 * scale)


def test_a_composite_checkpoint_is_quantized_with_its_statistics(
    hf_model: HfFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its projections are ``model.language_model.layers.*``: each must be GPTQ's, not the
    round to nearest written without statistics."""
    folder, _ = hf_model("Qwen3_5ForConditionalGeneration")
    hessians = collect_hessians(folder, SAMPLES)
    with caplog.at_level(logging.WARNING, logger=WRITER_LOG):
        write_w4a16(folder, tmp_path / "gptq", group_size=GROUP, hessians=hessians)
    assert "no calibration statistics" not in caplog.text
    write_w4a16(folder, tmp_path / "rtn", group_size=GROUP)
    gptq, rtn = read_tensors(tmp_path / "gptq"), read_tensors(tmp_path / "rtn")
    codes = [name for name in gptq if name.endswith(".qweight")]
    assert codes and all(name.startswith("model.language_model.layers.") for name in codes)
    same = [name for name in codes if torch.equal(gptq[name], rtn[name])]
    assert not same, f"rounded to nearest despite calibration: {same}"


def test_what_is_rounded_to_nearest_is_named_in_one_line(
    hf_model: HfFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A projection whose statistics are missing is named; routed experts are GPTQ's but
    those no token was routed to (no statistics), which are counted per layer; the rest of
    the experts are not named."""
    folder, _ = hf_model("Qwen3_5MoeForCausalLM")
    hessians = collect_hessians(folder, SAMPLES)
    missing = "model.layers.0.linear_attn.out_proj"
    del hessians[missing]
    unrouted = [f"model.layers.1.mlp.experts.{e}" for e in (2, 5)]
    for expert in unrouted:
        for part in ("gate_proj", "up_proj", "down_proj"):
            hessians.pop(f"{expert}.{part}", None)
    with caplog.at_level(logging.WARNING, logger=WRITER_LOG):
        write_w4a16(folder, tmp_path / "gptq", group_size=GROUP, hessians=hessians)
    lines = [r.getMessage() for r in caplog.records if "no calibration statistics" in r.message]
    assert len(lines) == 1
    assert set(lines[0].rpartition(": ")[2].split(", ")) == {missing}
    lines = [r.getMessage() for r in caplog.records if "routed to some experts" in r.message]
    assert len(lines) == 1
    assert lines[0].rpartition(": ")[2] == "model.layers.1.mlp.experts 2 of 8"

    write_w4a16(folder, tmp_path / "rtn", group_size=GROUP)
    gptq, rtn = read_tensors(tmp_path / "gptq"), read_tensors(tmp_path / "rtn")
    experts = [name for name in gptq if ".mlp.experts." in name and name.endswith(".qweight")]
    assert len(experts) == 2 * 8 * 3
    same = {name for name in experts if torch.equal(gptq[name], rtn[name])}
    assert same == {
        f"{e}.{p}.qweight" for e in unrouted for p in ("gate_proj", "up_proj", "down_proj")
    }


def test_an_expert_whose_statistics_are_zeros_is_rounded_to_nearest(
    hf_model: HfFactory, tmp_path: Path
) -> None:
    """An all-zero Hessian (no input reached it) would make GPTQ zero every weight."""
    folder, _ = hf_model("Qwen3MoeForCausalLM")
    hessians = collect_hessians(folder, SAMPLES)
    expert = "model.layers.0.mlp.experts.3"
    for part in ("gate_proj", "up_proj", "down_proj"):
        key = f"{expert}.{part}"
        hessians[key] = torch.zeros_like(hessians[key])
    write_w4a16(folder, tmp_path / "gptq", group_size=GROUP, hessians=hessians)
    write_w4a16(folder, tmp_path / "rtn", group_size=GROUP)
    gptq, rtn = read_tensors(tmp_path / "gptq"), read_tensors(tmp_path / "rtn")
    for part in ("gate_proj", "up_proj", "down_proj"):
        for tensor in ("qweight", "qzeros", "scales"):
            name = f"{expert}.{part}.{tensor}"
            assert torch.equal(gptq[name], rtn[name]), name


def test_experts_too_large_to_hold_statistics_for_are_left_to_round_to_nearest(
    hf_model: HfFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """With less memory free than twice what the experts' sums take (per expert an [H, H]
    and an [I, I] float64), the experts get none and a warning says why; every other
    projection still gets its own. With just enough, they get theirs."""
    folder, model = hf_model("Qwen3MoeForCausalLM")
    config = model.config
    moe_layers = sum(type(m).__name__.endswith("SparseMoeBlock") for m in model.modules())
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    needed = moe_layers * config.num_experts * (hidden**2 + inter**2) * 8
    with caplog.at_level(logging.WARNING, logger="tandem.core.models.calibration"):
        starved = collect_hessians(folder, SAMPLES, free_bytes=lambda: 2 * needed - 1)
    assert "the routed experts' statistics would take" in caplog.text
    assert not [name for name in starved if ".mlp.experts." in name]
    assert any(name.endswith(".self_attn.q_proj") for name in starved)
    enough = collect_hessians(folder, SAMPLES, free_bytes=lambda: 2 * needed)
    assert [name for name in enough if ".mlp.experts." in name]
