"""The parts of a Hugging Face ``config.json`` the decoder models use (``config_json.py``
reads them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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

    @property
    def has_linear_attention(self) -> bool:
        """Whether some layers keep a per-sequence state (hybrid models override this)."""
        return False
