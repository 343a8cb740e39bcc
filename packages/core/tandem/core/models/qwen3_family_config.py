"""The ``config.json`` of the Qwen3-MoE, Qwen3.5 and Qwen3.5-MoE families.

``Qwen3FamilyConfig`` is a ``ModelConfig`` (everything the engine reads stays where it was)
plus what these families add: the per-layer mix of linear (Gated DeltaNet) and full
attention, mixture-of-experts settings, partial rotary and the Qwen3.5 switches (gated
attention output, zero-centred RMSNorm). Missing fields take the defaults of the transformers
config classes (``Qwen3MoeConfig``, ``Qwen3_5TextConfig``, ``Qwen3_5MoeTextConfig``); the
``*ForConditionalGeneration`` configs keep the text model under ``text_config``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tandem.core.errors import ModelLoadError
from tandem.core.models.model_config import ModelConfig

logger = logging.getLogger(__name__)

QWEN3_MOE = "Qwen3MoeForCausalLM"
QWEN3_5_ARCHITECTURES = (
    "Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration",
)
FAMILY_ARCHITECTURES = (QWEN3_MOE, *QWEN3_5_ARCHITECTURES)

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"

# The transformers config classes' defaults, for fields a config.json leaves out.
_QWEN3_MOE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "use_sliding_window": False,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 768,
    "num_experts_per_tok": 8,
    "num_experts": 128,
    "norm_topk_prob": False,
    "mlp_only_layers": [],
}
_QWEN3_5_DEFAULTS: dict[str, Any] = {
    "vocab_size": 248320,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "full_attention_interval": 4,
}
_QWEN3_5_MOE_DEFAULTS: dict[str, Any] = {
    **_QWEN3_5_DEFAULTS,
    "intermediate_size": 0,  # every layer is sparse: no dense MLP
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_key_value_heads": 2,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 8,
    "num_experts": 256,
}
# transformers' PreTrainedConfig.default_theta
_DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class Qwen3FamilyConfig(ModelConfig):
    # Per layer: "linear_attention" or "full_attention".
    layer_types: tuple[str, ...]
    # Per layer: a sparse mixture-of-experts block (True) or the dense gated MLP.
    moe_layers: tuple[bool, ...]
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    # Renormalise the top-k routing weights to sum to one (always on in Qwen3.5-MoE).
    norm_topk_prob: bool
    # Size of the sigmoid-gated shared expert beside the routed ones; 0 = none.
    shared_expert_intermediate_size: int
    # Rotary covers the first ``int(head_dim * partial_rotary_factor)`` dims of each head.
    partial_rotary_factor: float
    # Qwen3.5: q_proj also yields a per-head output gate, attention out *= sigmoid(gate).
    gated_attention: bool
    # Qwen3.5: every RMSNorm but the gated one scales by (1 + weight).
    zero_centered_norm: bool
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def has_linear_attention(self) -> bool:
        return LINEAR_ATTENTION in self.layer_types


def parse_family_config(raw: dict[str, Any], arch: str) -> Qwen3FamilyConfig:
    """Parse a ``config.json`` of one of ``FAMILY_ARCHITECTURES``. A missing or malformed
    field raises KeyError, TypeError or ValueError: ``parse_model_config``, the one caller,
    turns those into a ModelLoadError for every architecture alike."""
    nested = arch.endswith("ForConditionalGeneration")
    text: dict[str, Any] = dict(raw.get("text_config") or {}) if nested else raw
    if arch == QWEN3_MOE:
        defaults = _QWEN3_MOE_DEFAULTS
    elif arch.startswith("Qwen3_5Moe"):
        defaults = _QWEN3_5_MOE_DEFAULTS
    else:
        defaults = _QWEN3_5_DEFAULTS

    def get(key: str) -> Any:
        value = text.get(key)
        return defaults[key] if value is None else value

    hidden = int(get("hidden_size"))
    heads = int(get("num_attention_heads"))
    num_layers = int(get("num_hidden_layers"))
    # Qwen3MoeConfig has no head_dim default: transformers falls back to hidden / heads.
    head_dim = int(text.get("head_dim") or defaults.get("head_dim") or hidden // heads)
    attention_bias = bool(get("attention_bias"))
    qwen3_5 = arch != QWEN3_MOE
    state_dtype = text.get("mamba_ssm_dtype")
    if qwen3_5 and state_dtype not in (None, "float32"):
        # Released Qwen3.5 checkpoints say float32. Kept at float32 whatever a config says:
        # more exact than asked, at twice the decode step's state traffic.
        logger.warning(
            "the config asks for a %s recurrent state (mamba_ssm_dtype); the Gated DeltaNet "
            "layers keep theirs in float32",
            state_dtype,
        )

    # Precedence as transformers' rope standardisation: rope_scaling, then rope_parameters,
    # then top-level keys, then defaults.
    rope = dict(text.get("rope_scaling") or text.get("rope_parameters") or {})
    rope_theta = float(rope.get("rope_theta", text.get("rope_theta", _DEFAULT_ROPE_THETA)))
    # Qwen3-MoE rotates whole heads; Qwen3.5 defaults to a quarter of each head.
    partial = 1.0
    if qwen3_5:
        partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    # M-RoPE sections only matter for image/video positions; text positions are equal in all
    # three sections, which is plain rotary.
    rope_scaling = None if rope_type == "default" else rope

    if qwen3_5:
        layer_types = tuple(str(t) for t in text.get("layer_types") or ())
        if not layer_types:
            interval = int(get("full_attention_interval"))
            layer_types = tuple(
                LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION
                for i in range(num_layers)
            )
    else:
        layer_types = (FULL_ATTENTION,) * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types names {len(layer_types)} layers, not {num_layers}")
    unknown = set(layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION}
    if unknown:
        raise ValueError(f"unknown layer_types {sorted(unknown)}")

    moe = arch == QWEN3_MOE or arch.startswith("Qwen3_5Moe")
    num_experts = int(text.get("num_experts") or text.get("num_local_experts") or 0)
    if moe and not num_experts:
        num_experts = int(defaults["num_experts"])
    if arch == QWEN3_MOE:
        if bool(get("use_sliding_window")):
            raise ModelLoadError(
                "Qwen3-MoE with use_sliding_window=true is not supported (paged attention here "
                "is full causal); set use_sliding_window to false if the model was trained so"
            )
        sparse_step = int(get("decoder_sparse_step"))
        mlp_only = {int(i) for i in get("mlp_only_layers")}
        moe_layers = tuple(
            i not in mlp_only and num_experts > 0 and (i + 1) % sparse_step == 0
            for i in range(num_layers)
        )
    else:
        moe_layers = (moe,) * num_layers

    eos = text.get("eos_token_id", raw.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    # A composite model ties its lm_head by the top-level flag, as transformers decides.
    tie = raw.get("tie_word_embeddings") if nested else text.get("tie_word_embeddings")
    return Qwen3FamilyConfig(
        architecture=arch,
        vocab_size=int(get("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(get("intermediate_size")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(text.get("num_key_value_heads") or defaults["num_key_value_heads"]),
        head_dim=head_dim,
        rms_norm_eps=float(get("rms_norm_eps")),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(get("max_position_embeddings")),
        tie_word_embeddings=bool(tie) if tie is not None else False,
        hidden_act=str(get("hidden_act")),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=False,
        qk_norm=True,
        checkpoint_dtype=str(
            raw.get("dtype") or raw.get("torch_dtype") or text.get("dtype") or "float32"
        ),
        bos_token_id=text.get("bos_token_id", raw.get("bos_token_id")),
        eos_token_ids=tuple(int(e) for e in eos_ids),
        layer_types=layer_types,
        moe_layers=moe_layers,
        num_experts=num_experts if moe else 0,
        num_experts_per_tok=int(get("num_experts_per_tok")) if moe else 0,
        moe_intermediate_size=int(get("moe_intermediate_size")) if moe else 0,
        norm_topk_prob=bool(get("norm_topk_prob")) if arch == QWEN3_MOE else moe,
        shared_expert_intermediate_size=(
            int(get("shared_expert_intermediate_size")) if moe and qwen3_5 else 0
        ),
        partial_rotary_factor=partial,
        gated_attention=qwen3_5,
        zero_centered_norm=qwen3_5,
        linear_num_key_heads=int(get("linear_num_key_heads")) if qwen3_5 else 0,
        linear_num_value_heads=int(get("linear_num_value_heads")) if qwen3_5 else 0,
        linear_key_head_dim=int(get("linear_key_head_dim")) if qwen3_5 else 0,
        linear_value_head_dim=int(get("linear_value_head_dim")) if qwen3_5 else 0,
        linear_conv_kernel_dim=int(get("linear_conv_kernel_dim")) if qwen3_5 else 0,
        mtp_layers=int(text.get("mtp_num_hidden_layers") or 0) if qwen3_5 else 0,
    )


def family_config(config: ModelConfig) -> Qwen3FamilyConfig:
    """``config`` as the family config a family model needs (a plain ``ModelConfig`` of one
    of these architectures was built by hand, not parsed, and lacks their fields)."""
    if not isinstance(config, Qwen3FamilyConfig):
        raise ValueError(
            f"{config.architecture} needs its config parsed by parse_model_config "
            "(a Qwen3FamilyConfig)"
        )
    return config
