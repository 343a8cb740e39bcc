"""``quantization_config``: the W8A8 schemes served, and a start-up refusal naming the field
for everything else."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from tandem.core.errors import ModelLoadError
from tandem.core.layers.quant_scheme import W8A8Scheme
from tandem.core.llm.model_runner import LLMRunnerFactory
from tandem.core.models.config_json import parse_model_config
from tandem.core.models.projection_match import DecoderLayout
from tandem.core.models.quantization_config import parse_quantization
from tandem.core.models.w8a8_writer import w8a8_quantization_config

BASE: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}
GROUP = ("config_groups", "group_0")


def _with(path: tuple[str, ...], value: object) -> dict[str, Any]:
    qc = copy.deepcopy(w8a8_quantization_config())
    node = qc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return {**BASE, "quantization_config": qc}


def test_float_dynamic_and_static_configs() -> None:
    assert parse_model_config(BASE).quantization is None
    dynamic = parse_model_config({**BASE, "quantization_config": w8a8_quantization_config()})
    assert dynamic.quantization == W8A8Scheme(static=False)
    static = _with((*GROUP, "input_activations"), {"num_bits": 8, "type": "int"})
    static["quantization_config"]["config_groups"]["group_0"]["input_activations"].update(
        symmetric=True, dynamic=False, strategy="tensor"
    )
    assert parse_model_config(static).quantization == W8A8Scheme(static=True)
    regex_ignore = _with(("ignore",), ["re:.*lm_head", "re:.*embed_tokens"])
    assert parse_model_config(regex_ignore).quantization == W8A8Scheme(static=False)


REFUSED = {
    "method": (("quant_method",), "bitsandbytes", "quant_method is 'bitsandbytes'"),
    "4-bit": ((*GROUP, "weights", "num_bits"), 4, "weights.num_bits is 4"),
    "fp8": ((*GROUP, "weights", "type"), "float", "weights.type is 'float'"),
    "asymmetric": ((*GROUP, "weights", "symmetric"), False, "weights.symmetric is False"),
    "group size": ((*GROUP, "weights", "strategy"), "group", "weights.strategy is 'group'"),
    "grouped": ((*GROUP, "weights", "group_size"), 128, "weights.group_size is 128"),
    "weight-only": ((*GROUP, "input_activations"), None, "input_activations is None"),
    "asymmetric activations": (
        (*GROUP, "input_activations", "symmetric"),
        False,
        "input_activations.symmetric is False",
    ),
    "static per token": (
        (*GROUP, "input_activations", "dynamic"),
        False,
        "input_activations.strategy is 'token'",
    ),
    "format": ((*GROUP, "format"), "pack-quantized", "group_0.format is 'pack-quantized'"),
    "status": (("quantization_status",), "frozen", "quantization_status is 'frozen'"),
    "kv cache": (("kv_cache_scheme",), {"num_bits": 8}, "kv_cache_scheme is"),
    "targets": ((*GROUP, "targets"), ["re:.*proj"], "targets is"),
    "lm_head quantized": (("ignore",), [], "ignore is []"),
    "a fused part left float": (
        ("ignore",),
        ["lm_head", "re:.*q_proj"],
        "all int8 or all float",
    ),
    "a projection left float in one layer": (
        ("ignore",),
        ["lm_head", "model.layers.0.mlp.down_proj"],
        "leaves mlp.down_proj float in some layers only",
    ),
}


def test_ignored_projections_are_served_float() -> None:
    raw = _with(("ignore",), ["lm_head", "re:.*down_proj"])
    scheme = parse_model_config(raw).quantization
    assert scheme == W8A8Scheme(static=False, float_projections=frozenset({"mlp.down_proj"}))


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_configs_are_refused_naming_the_field(case: str) -> None:
    path, value, said = REFUSED[case]
    with pytest.raises(ModelLoadError) as caught:
        parse_model_config(_with(path, value))
    message = str(caught.value)
    assert said in message and "quantization_config" in message
    assert "supported" in message


def test_an_architecture_without_int8_layers_is_refused() -> None:
    raw = {"quantization_config": w8a8_quantization_config()}
    with pytest.raises(ModelLoadError, match="PluginForCausalLM are not supported") as caught:
        parse_quantization(raw, "PluginForCausalLM", False, DecoderLayout(2))
    assert "Qwen3_5MoeForCausalLM" in str(caught.value)


# A Qwen3-MoE config: every layer sparse unless ``mlp_only_layers`` says otherwise.
MOE: dict[str, Any] = {
    **BASE,
    "architectures": ["Qwen3MoeForCausalLM"],
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}
ROUTERS = "re:.*mlp.gate$"


def _moe(ignore: list[str], static: bool = False, **changes: Any) -> dict[str, Any]:
    qc = w8a8_quantization_config(routers=True)
    qc["ignore"] = ignore
    if static:
        qc["config_groups"]["group_0"]["input_activations"].update(dynamic=False, strategy="tensor")
    return {**MOE, **changes, "quantization_config": qc}


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_moe_checkpoints_quantize_the_experts_and_leave_the_routers_float(static: bool) -> None:
    """As llm-compressor's MoE recipes write them: the routers ignored, every expert int8."""
    for ignore in (["lm_head", ROUTERS], ["lm_head", "re:.*mlp.gate.*"]):
        assert parse_model_config(_moe(ignore, static)).quantization == W8A8Scheme(static)
    dense_between = _moe(["lm_head", ROUTERS], static, mlp_only_layers=[1])
    assert parse_model_config(dense_between).quantization == W8A8Scheme(static)


MOE_REFUSED = {
    "a quantized router": (
        _moe(["lm_head"]),
        "no entry leaves the router model.layers.0.mlp.gate float",
    ),
    "experts left float": (
        _moe(["lm_head", ROUTERS, "re:.*experts.*"]),
        "leaves model.layers.0.mlp.experts.0.gate_proj float",
    ),
    "one expert left float": (
        _moe(["lm_head", ROUTERS, "model.layers.1.mlp.experts.3.down_proj"]),
        "leaves model.layers.1.mlp.experts.3.down_proj float",
    ),
    # The same entry is harmless where the dense MLP is not (every layer sparse).
    "half a dense layer's fused MLP left float": (
        _moe(["lm_head", "re:.*mlp.gate.*"], mlp_only_layers=[1]),
        "mlp.gate_proj, mlp.up_proj all int8 or all float",
    ),
}


@pytest.mark.parametrize("case", sorted(MOE_REFUSED))
def test_moe_configs_that_cannot_be_served_are_refused_naming_the_module(case: str) -> None:
    raw, said = MOE_REFUSED[case]
    with pytest.raises(ModelLoadError) as caught:
        parse_model_config(raw)
    message = str(caught.value)
    assert said in message and "quantization_config.ignore" in message


def test_the_engine_refuses_before_loading_weights(tmp_path: Path) -> None:
    """Start-up reads the config first: no weights need to exist for the refusal."""
    (tmp_path / "config.json").write_text(json.dumps(_with(("quant_method",), "bitsandbytes")))
    with pytest.raises(ModelLoadError, match="quant_method is 'bitsandbytes'"):
        LLMRunnerFactory.from_folder(tmp_path)
