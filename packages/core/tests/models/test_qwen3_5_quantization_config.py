"""Which projections of a Qwen3.5-MoE checkpoint are quantized, read from its config as vLLM
reads it: llm-compressor's ignore list for Qwen3.5 (linear attention kept float), GPTQModel's
``dynamic`` exclusions (Qwen's GPTQ releases keep every attention float), and the gates that
must stay float."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tandem.core.errors import ModelLoadError
from tandem.core.layers.quant_scheme import (
    EXPERTS,
    LINEAR_ATTENTION_PROJECTIONS,
    SHARED_EXPERT_PROJECTIONS,
    W4A16Scheme,
    W8A8Scheme,
)
from tandem.core.models.config_json import parse_model_config
from tandem.core.models.w4a16_writer import gptq_quantization_config
from tandem.core.models.w8a8_writer import w8a8_quantization_config

QWEN3_5_MOE: dict[str, Any] = {
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "full_attention_interval": 2,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}
# llm-compressor's examples/quantization_w8a8_fp8/qwen3_5_moe.py, as its ignore list reads.
LLM_COMPRESSOR_IGNORE = [
    "re:.*lm_head",
    "re:visual.*",
    "re:model.visual.*",
    "re:.*mlp.gate$",
    "re:.*embed_tokens$",
    "re:.*shared_expert_gate$",
    "re:.*mlp\\.shared_expert$",
    "re:.*linear_attn.*",
]


def _w8a8(ignore: list[str]) -> dict[str, Any]:
    return {**QWEN3_5_MOE, "quantization_config": w8a8_quantization_config(ignore=ignore)}


def test_llm_compressors_list_keeps_the_linear_attention_float() -> None:
    scheme = parse_model_config(_w8a8(LLM_COMPRESSOR_IGNORE)).quantization
    assert scheme == W8A8Scheme(
        static=False, float_projections=frozenset(LINEAR_ATTENTION_PROJECTIONS)
    )


def test_every_projection_quantized_but_the_gates() -> None:
    ignore = ["lm_head", "re:.*mlp.gate$", "re:.*mlp.shared_expert_gate$"]
    assert parse_model_config(_w8a8(ignore)).quantization == W8A8Scheme(static=False)


def test_a_composite_checkpoints_exact_names_are_matched() -> None:
    names = [
        f"model.language_model.layers.0.{p}"
        for p in ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z")
    ]
    scheme = parse_model_config(_w8a8(["lm_head", "re:.*gate$", *names])).quantization
    assert scheme == W8A8Scheme(
        static=False, float_projections=frozenset(LINEAR_ATTENTION_PROJECTIONS[:2])
    )


REFUSED = {
    "a quantized shared-expert gate": (
        ["lm_head", "re:.*mlp.gate$"],
        "no entry leaves the shared-expert gate model.layers.0.mlp.shared_expert_gate float",
    ),
    "in_proj_qkv without in_proj_z": (
        ["lm_head", "re:.*gate$", "re:.*in_proj_qkv$"],
        "linear_attn.in_proj_qkv, linear_attn.in_proj_z all int8 or all float",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unservable_ignore_lists_are_refused(case: str) -> None:
    ignore, said = REFUSED[case]
    with pytest.raises(ModelLoadError) as caught:
        parse_model_config(_w8a8(ignore))
    assert said in str(caught.value)


def test_gptq_dynamic_exclusions_keep_every_attention_float() -> None:
    """``-:.*attn.*``, as Qwen's Qwen3.5 GPTQ-Int4 releases write it: 4-bit experts and
    shared expert, float attention and linear attention."""
    qc = gptq_quantization_config(group_size=128, sym=True, quantized=frozenset())
    qc["dynamic"] = {"-:.*attn.*": {}}
    qc.pop("modules_in_block_to_quantize", None)
    scheme = parse_model_config({**QWEN3_5_MOE, "quantization_config": qc}).quantization
    assert isinstance(scheme, W4A16Scheme)
    assert scheme.quantized & {*LINEAR_ATTENTION_PROJECTIONS, "self_attn.q_proj"} == set()
    assert scheme.quantized >= {EXPERTS, *SHARED_EXPERT_PROJECTIONS}


def test_exclusions_of_the_parts_served_float_are_not_warned_of(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The vision tower, the multi-token-prediction head and the shared expert's gate, as
    Qwen's releases exclude them, match modules of the model (served float here anyway)."""
    qc = gptq_quantization_config(group_size=128, sym=True, quantized=frozenset())
    qc.pop("modules_in_block_to_quantize", None)
    qc["dynamic"] = {"-:.*visual.*": {}, "-:.*mtp.*": {}, "-:.*shared_expert_gate": {}}
    with caplog.at_level(logging.WARNING, logger="tandem.core.models.gptq_config"):
        parse_model_config({**QWEN3_5_MOE, "quantization_config": qc})
    assert caplog.records == []
