"""The family configs parse as transformers reads them: its class defaults for missing fields,
the nested text config of composite checkpoints, the MoE layer pattern; a recurrent state
dtype other than the float32 Tandem keeps is named in a warning; the dense path keeps its
ModelConfig; the engine serves all five architectures and names them when refusing
another."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import transformers

from tandem.core.errors import ModelLoadError
from tandem.core.models.config_json import parse_model_config
from tandem.core.models.model_config import ModelConfig
from tandem.core.models.qwen3_5 import Qwen3_5ForCausalLM
from tandem.core.models.qwen3_family_config import QWEN3_5_ARCHITECTURES, Qwen3FamilyConfig
from tandem.core.models.qwen3_moe import Qwen3MoeForCausalLM
from tandem.core.models.registry import model_class


def _parse(raw: dict[str, Any]) -> Qwen3FamilyConfig:
    config = parse_model_config(raw)
    assert isinstance(config, Qwen3FamilyConfig)
    return config


def test_a_bare_qwen3_5_config_takes_the_transformers_defaults() -> None:
    config = _parse({"architectures": ["Qwen3_5ForCausalLM"], "num_hidden_layers": 8})
    reference = transformers.Qwen3_5TextConfig(num_hidden_layers=8)
    assert config.layer_types == tuple(reference.layer_types or ())
    assert config.layer_types[3] == "full_attention" and config.layer_types[2] == "linear_attention"
    rope: Any = reference.rope_parameters
    assert config.partial_rotary_factor == rope["partial_rotary_factor"] == 0.25
    assert config.rope_theta == rope["rope_theta"]
    assert config.rotary_dim == 64
    for ours, theirs in [
        (config.hidden_size, reference.hidden_size),
        (config.head_dim, reference.head_dim),
        (config.num_kv_heads, reference.num_key_value_heads),
        (config.vocab_size, reference.vocab_size),
        (config.max_position_embeddings, reference.max_position_embeddings),
        (config.linear_num_key_heads, reference.linear_num_key_heads),
        (config.linear_num_value_heads, reference.linear_num_value_heads),
        (config.linear_key_head_dim, reference.linear_key_head_dim),
        (config.linear_value_head_dim, reference.linear_value_head_dim),
        (config.linear_conv_kernel_dim, reference.linear_conv_kernel_dim),
    ]:
        assert ours == theirs
    assert config.gated_attention and config.zero_centered_norm and config.qk_norm
    assert config.moe_layers == (False,) * 8 and config.num_experts == 0


@pytest.mark.parametrize(
    ("asked", "warned"), [(None, False), ("float32", False), ("bfloat16", True)]
)
def test_a_recurrent_state_dtype_other_than_float32_is_named_in_a_warning(
    asked: str | None, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    raw: dict[str, Any] = {"architectures": ["Qwen3_5ForCausalLM"], "num_hidden_layers": 4}
    if asked is not None:
        raw["mamba_ssm_dtype"] = asked
    with caplog.at_level(logging.WARNING, logger="tandem.core.models.qwen3_family_config"):
        _parse(raw)
    named = [r.getMessage() for r in caplog.records if "mamba_ssm_dtype" in r.getMessage()]
    assert named == (
        ["the config asks for a bfloat16 recurrent state (mamba_ssm_dtype); the Gated DeltaNet "
         "layers keep theirs in float32"] if warned else []
    )  # fmt: skip


def test_full_attention_interval_and_explicit_partial_rotary() -> None:
    config = _parse(
        {
            "architectures": ["Qwen3_5ForCausalLM"],
            "num_hidden_layers": 4,
            "full_attention_interval": 2,
            "rope_parameters": {"rope_theta": 1e6, "partial_rotary_factor": 0.5},
        }
    )
    assert config.layer_types == ("linear_attention", "full_attention") * 2
    assert config.partial_rotary_factor == 0.5 and config.rope_theta == 1e6


def test_composite_config_reads_the_text_config_and_the_top_level_tie() -> None:
    raw = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "tie_word_embeddings": True,
        "dtype": "bfloat16",
        "text_config": {
            "num_hidden_layers": 2,
            "layer_types": ["full_attention", "linear_attention"],
            "num_experts": 16,
            "eos_token_id": 7,
            "tie_word_embeddings": False,
        },
        "vision_config": {"depth": 2},
    }
    config = _parse(raw)
    reference = transformers.Qwen3_5MoeTextConfig()
    assert config.tie_word_embeddings  # transformers ties a composite model by the top level
    assert config.checkpoint_dtype == "bfloat16" and config.eos_token_ids == (7,)
    assert config.layer_types == ("full_attention", "linear_attention")
    assert config.num_experts == 16 and config.moe_layers == (True, True)
    assert config.num_experts_per_tok == reference.num_experts_per_tok
    assert config.moe_intermediate_size == reference.moe_intermediate_size
    assert config.shared_expert_intermediate_size == reference.shared_expert_intermediate_size
    assert config.norm_topk_prob  # Qwen3.5-MoE always renormalises its top-k
    assert config.hidden_size == reference.hidden_size


def test_qwen3_moe_layer_pattern_and_expert_count_names() -> None:
    raw = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_hidden_layers": 6,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
        "num_local_experts": 4,  # what transformers 5 writes; releases say num_experts
        "hidden_size": 64,
        "num_attention_heads": 4,
    }
    config = _parse(raw)
    assert config.moe_layers == (False, True, False, False, False, True)
    assert config.num_experts == 4 and not config.norm_topk_prob
    assert config.head_dim == 16  # hidden / heads: Qwen3MoeConfig has no head_dim default
    assert config.partial_rotary_factor == 1.0 and not config.gated_attention
    assert config.layer_types == ("full_attention",) * 6
    with pytest.raises(ModelLoadError, match="use_sliding_window"):
        parse_model_config({**raw, "use_sliding_window": True})


def test_dense_configs_stay_plain() -> None:
    raw = {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    assert type(parse_model_config(raw)) is ModelConfig


def test_the_engine_serves_every_family_architecture_and_names_the_ones_it_does_not() -> None:
    for architecture in QWEN3_5_ARCHITECTURES:
        assert model_class(architecture) is Qwen3_5ForCausalLM
    assert model_class("Qwen3MoeForCausalLM") is Qwen3MoeForCausalLM
    with pytest.raises(ModelLoadError, match="Qwen3_5MoeForConditionalGeneration"):
        model_class("Qwen3NextForCausalLM")
