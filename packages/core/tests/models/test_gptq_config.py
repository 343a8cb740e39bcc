"""A GPTQ ``quantization_config``: the 4-bit schemes served, and a start-up refusal naming
the field for everything else."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tandem.core.errors import ModelLoadError
from tandem.core.layers.quant_scheme import EXPERTS, PROJECTIONS, W4A16Scheme
from tandem.core.models.config_json import parse_model_config
from tandem.core.models.projection_match import DecoderLayout
from tandem.core.models.quantization_config import parse_quantization
from tandem.core.models.w4a16_writer import gptq_quantization_config

from .test_quantization_config import BASE, MOE

ALL = frozenset(PROJECTIONS)
LAYOUT = DecoderLayout(2)


def _config(**changes: Any) -> dict[str, Any]:
    qc = gptq_quantization_config(group_size=128, sym=True, quantized=ALL)
    qc.update(changes)
    return {**BASE, "quantization_config": {k: v for k, v in qc.items() if v is not None}}


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("sym", [True, False])
def test_served_group_sizes_and_zero_points(group_size: int, sym: bool) -> None:
    scheme = parse_model_config(_config(group_size=group_size, sym=sym)).quantization
    assert scheme == W4A16Scheme(group_size=group_size, sym=sym, desc_act=False)


def test_activation_order_is_kept_unless_there_is_one_group_per_channel() -> None:
    assert parse_model_config(_config(desc_act=True)).quantization == W4A16Scheme(
        group_size=128, sym=True, desc_act=True
    )
    per_channel = parse_model_config(_config(desc_act=True, group_size=-1)).quantization
    assert per_channel == W4A16Scheme(group_size=-1, sym=True, desc_act=False)


def test_a_minimal_config_takes_autogptq_defaults() -> None:
    raw = {**BASE, "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 64}}
    assert parse_model_config(raw).quantization == W4A16Scheme(64, sym=True, desc_act=False)


@pytest.mark.parametrize(
    "modules",
    [
        [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"]],
        ["q_proj", "k_proj", "v_proj", "o_proj"],
    ],
    ids=["nested", "flat"],
)
def test_modules_in_block_to_quantize_leave_the_others_float(modules: list[Any]) -> None:
    scheme = parse_model_config(_config(modules_in_block_to_quantize=modules)).quantization
    assert isinstance(scheme, W4A16Scheme)
    assert scheme.quantized == frozenset(PROJECTIONS[:4])


REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "8-bit": ({"bits": 8}, "bits is 8"),
    "3-bit": ({"bits": 3}, "bits is 3"),
    "group size 16": ({"group_size": 16}, "group_size is 16"),
    "group size missing": ({"group_size": None}, "group_size is None"),
    "gptq_v2": ({"checkpoint_format": "gptq_v2"}, "checkpoint_format is 'gptq_v2'"),
    "marlin": ({"checkpoint_format": "marlin"}, "checkpoint_format is 'marlin'"),
    "quantized lm_head": ({"lm_head": True}, "lm_head is True"),
    "dynamic override": ({"dynamic": {"+:.*down_proj": {"bits": 8}}}, "dynamic is"),
    "dynamic exclusion of a fused part": (
        {"dynamic": {"-:.*q_proj": {}}},
        "all 4-bit or all float",
    ),
    "sym not a flag": ({"sym": "yes"}, "sym is 'yes'"),
    "fused parts apart": (
        {"modules_in_block_to_quantize": [["self_attn.q_proj", "self_attn.k_proj"]]},
        "all 4-bit or all float",
    ),
    "unknown module": (
        {"modules_in_block_to_quantize": [["mlp.experts"]]},
        "'mlp.experts' names none of",
    ),
    "one layer only": (
        {"modules_in_block_to_quantize": ["model.layers.0.self_attn.o_proj"]},
        "the same projections in every layer",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_configs_are_refused_naming_the_field(case: str) -> None:
    changes, said = REFUSED[case]
    with pytest.raises(ModelLoadError) as caught:
        parse_model_config(_config(**changes))
    message = str(caught.value)
    assert said in message and "quantization_config." in message
    assert "supported" in message


def test_dynamic_exclusions_leave_their_modules_float() -> None:
    """GPTQModel's ``-:`` keys, as Qwen's GPTQ releases of Qwen3.5 write them."""
    scheme = parse_model_config(_config(dynamic={"-:.*down_proj": {}})).quantization
    assert isinstance(scheme, W4A16Scheme)
    assert scheme.quantized == ALL - {"mlp.down_proj"}


def test_an_exclusion_that_matches_no_module_is_warned_of(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM ignores it silently; a typo there leaves 4-bit what was meant float."""
    dynamic: dict[str, Any] = {
        "-:.*down_proj": {},
        "-:.*dwon_proj": {},
        "-:model\\.layers\\.9\\..*": {},
    }
    with caplog.at_level(logging.WARNING, logger="tandem.core.models.gptq_config"):
        scheme = parse_model_config(_config(dynamic=dynamic)).quantization
    assert isinstance(scheme, W4A16Scheme) and scheme.quantized == ALL - {"mlp.down_proj"}
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1
    assert "quantization_config.dynamic '-:.*dwon_proj', '-:model\\\\.layers\\\\.9" in warned[0]
    assert "'-:.*down_proj'" not in warned[0]


def test_an_architecture_without_quantized_layers_is_refused() -> None:
    qc = _config()["quantization_config"]
    with pytest.raises(ModelLoadError, match="PluginForCausalLM are not supported"):
        parse_quantization({"quantization_config": qc}, "PluginForCausalLM", False, LAYOUT)


def _moe(**changes: Any) -> dict[str, Any]:
    return {**MOE, "quantization_config": _config(**changes)["quantization_config"]}


ATTENTION = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]


@pytest.mark.parametrize(
    ("modules", "quantized"),
    [
        (None, frozenset(PROJECTIONS) | {EXPERTS}),
        # Named one by one, as GPTQModel lists them, or by vLLM's module name.
        ([ATTENTION, ["mlp.experts.0.gate_proj", "mlp.experts.0.up_proj"]], {*ATTENTION, EXPERTS}),
        ([*ATTENTION, "mlp.experts"], {*ATTENTION, EXPERTS}),
        # Not named: the experts are float (vLLM would quantize them regardless).
        ([ATTENTION], set(ATTENTION)),
    ],
    ids=["all", "per expert", "experts module", "attention only"],
)
def test_moe_checkpoints_quantize_the_experts_they_name(
    modules: list[Any] | None, quantized: set[str]
) -> None:
    scheme = parse_model_config(_moe(modules_in_block_to_quantize=modules)).quantization
    assert isinstance(scheme, W4A16Scheme)
    assert scheme.quantized == frozenset(quantized)


def test_a_moe_list_naming_the_router_is_refused() -> None:
    with pytest.raises(ModelLoadError, match=r"'mlp\.gate' names none of the supported"):
        parse_model_config(_moe(modules_in_block_to_quantize=[[*ATTENTION, "mlp.gate"]]))
