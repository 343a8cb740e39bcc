"""The parts of a Hugging Face ``config.json`` the decoder models use (``config_json.py``
reads them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.core.layers.quant_scheme import QuantScheme


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str
    # Bias on q/k/v (Qwen2 always, Llama when attention_bias) and on o_proj (Llama only).
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    # Per-head RMSNorm on q and k before rotary (Qwen3).
    qk_norm: bool
    checkpoint_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # How the checkpoint's linear layers are quantized (``quantization_config``, read by
    # ``quantization_config.py``); None: float. Keyword-only so that subclasses' fields need
    # no defaults.
    quantization: QuantScheme | None = field(default=None, kw_only=True)
    # Layers of the multi-token-prediction head the checkpoint ships (Qwen3.5's ``mtp.*``,
    # ``mtp_num_hidden_layers``); 0: none.
    mtp_layers: int = field(default=0, kw_only=True)
    # Build and load that head: speculative decoding's "mtp" method drafts with it.
    serve_mtp: bool = field(default=False, kw_only=True)

    @property
    def has_linear_attention(self) -> bool:
        """Whether some layers keep a per-sequence state (hybrid models override this)."""
        return False


def parse_plain_config(raw: dict[str, Any], arch: str) -> ModelConfig:
    """The dense decoders' config (Llama, Qwen2, Qwen3) from a parsed ``config.json``. A
    missing or malformed field raises KeyError, TypeError or ValueError (the caller says
    which, for every architecture alike)."""
    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    rope_params = raw.get("rope_parameters") or {}
    rope_scaling = raw.get("rope_scaling") or (
        rope_params if rope_params.get("rope_type", "default") != "default" else None
    )
    theta = raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        hidden_act=str(raw.get("hidden_act", "silu")),
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
        o_bias=arch == "LlamaForCausalLM" and bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        checkpoint_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=tuple(int(e) for e in eos_ids),
    )
