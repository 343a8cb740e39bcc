"""Demo models of the Qwen3.5 family (Qwen3.5-27B crashed in xLLM pull request #1894's review)
and of Qwen3-MoE, written like the embedded default model (random weights from a fixed seed, the
demo BPE tokenizer, Hugging Face layout and names, so that transformers and other engines load
them too): a Qwen3.5 hybrid (``Qwen3_5ForCausalLM``, Gated DeltaNet layers with every
``full_attention_interval``-th one gated full attention) and a Qwen3-MoE model
(``Qwen3MoeForCausalLM``, routed experts in every layer).

Each kind has presets: ``demo`` (small, quick to serve) and ``bench`` (about 100M parameters,
the size the benchmarks are measured on). Same arguments, same bytes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tandem.core.demo.demo_model import DemoTokens, write_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Qwen3_5DemoSpec:
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 4
    # Every n-th layer is full attention, the others Gated DeltaNet (Qwen3.5 uses 4).
    full_attention_interval: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 32
    linear_value_head_dim: int = 32
    conv_kernel_size: int = 4
    partial_rotary_factor: float = 0.25
    vocab_size: int = 2048
    max_position_embeddings: int = 4096
    seed: int = 0
    init_std: float = 0.02


@dataclass(frozen=True)
class Qwen3MoeDemoSpec:
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 256
    norm_topk_prob: bool = True
    vocab_size: int = 2048
    max_position_embeddings: int = 4096
    seed: int = 0
    init_std: float = 0.02


QWEN3_5_PRESETS: dict[str, Qwen3_5DemoSpec] = {
    "demo": Qwen3_5DemoSpec(),
    # ~100M parameters: 12 layers (9 Gated DeltaNet, 3 full attention), hidden 768.
    "bench": Qwen3_5DemoSpec(
        hidden_size=768,
        intermediate_size=2560,
        num_layers=12,
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
    ),
}
QWEN3_MOE_PRESETS: dict[str, Qwen3MoeDemoSpec] = {
    "demo": Qwen3MoeDemoSpec(),
    # ~100M parameters (about a quarter active per token): 12 layers of 8 experts, top 2.
    "bench": Qwen3MoeDemoSpec(
        hidden_size=512, num_layers=12, num_heads=8, num_kv_heads=2, head_dim=64,
        moe_intermediate_size=640,
    ),
}  # fmt: skip

Weights = dict[str, torch.Tensor]


class _Init:
    """The seeded random source every tensor of one model is drawn from, in a fixed order."""

    def __init__(self, seed: int, std: float) -> None:
        self._g = torch.Generator().manual_seed(seed)
        self._std = std

    def normal(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self._g) * self._std

    def uniform(self, low: float, high: float, size: int) -> torch.Tensor:
        return low + (high - low) * torch.rand(size, generator=self._g)


def _attention(w: Weights, init: _Init, prefix: str, hidden: int, heads: int, kv_heads: int,
               head_dim: int, gated: bool, zero_centered: bool) -> None:  # fmt: skip
    # A gated query projection yields each head's query followed by its output gate.
    w[prefix + "q_proj.weight"] = init.normal(heads * head_dim * (2 if gated else 1), hidden)
    w[prefix + "k_proj.weight"] = init.normal(kv_heads * head_dim, hidden)
    w[prefix + "v_proj.weight"] = init.normal(kv_heads * head_dim, hidden)
    w[prefix + "o_proj.weight"] = init.normal(hidden, heads * head_dim)
    norm = torch.zeros if zero_centered else torch.ones
    w[prefix + "q_norm.weight"] = norm(head_dim)
    w[prefix + "k_norm.weight"] = norm(head_dim)


def _mlp(w: Weights, init: _Init, prefix: str, hidden: int, intermediate: int) -> None:
    w[prefix + "gate_proj.weight"] = init.normal(intermediate, hidden)
    w[prefix + "up_proj.weight"] = init.normal(intermediate, hidden)
    w[prefix + "down_proj.weight"] = init.normal(hidden, intermediate)


def _gated_delta_net(w: Weights, init: _Init, prefix: str, spec: Qwen3_5DemoSpec) -> None:
    key_dim = spec.linear_num_key_heads * spec.linear_key_head_dim
    value_dim = spec.linear_num_value_heads * spec.linear_value_head_dim
    heads, h = spec.linear_num_value_heads, spec.hidden_size
    w[prefix + "in_proj_qkv.weight"] = init.normal(2 * key_dim + value_dim, h)
    w[prefix + "in_proj_z.weight"] = init.normal(value_dim, h)
    w[prefix + "in_proj_b.weight"] = init.normal(heads, h)
    w[prefix + "in_proj_a.weight"] = init.normal(heads, h)
    w[prefix + "conv1d.weight"] = init.normal(2 * key_dim + value_dim, 1, spec.conv_kernel_size)
    # As the reference initialises them: decay rates A in [1, 16), time-step bias one.
    w[prefix + "A_log"] = init.uniform(1.0, 16.0, heads).log()
    w[prefix + "dt_bias"] = torch.ones(heads)
    w[prefix + "norm.weight"] = torch.ones(spec.linear_value_head_dim)
    w[prefix + "out_proj.weight"] = init.normal(h, value_dim)


def _qwen3_5_weights(spec: Qwen3_5DemoSpec, vocab: int) -> Weights:
    init, h = _Init(spec.seed, spec.init_std), spec.hidden_size
    # Zero-centred RMSNorms scale by (1 + weight): zero is the identity.
    w = {"model.embed_tokens.weight": init.normal(vocab, h), "model.norm.weight": torch.zeros(h)}
    w["lm_head.weight"] = init.normal(vocab, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        if (i + 1) % spec.full_attention_interval:
            _gated_delta_net(w, init, p + "linear_attn.", spec)
        else:
            _attention(w, init, p + "self_attn.", h, spec.num_heads, spec.num_kv_heads,
                       spec.head_dim, gated=True, zero_centered=True)  # fmt: skip
        _mlp(w, init, p + "mlp.", h, spec.intermediate_size)
        w[p + "input_layernorm.weight"] = torch.zeros(h)
        w[p + "post_attention_layernorm.weight"] = torch.zeros(h)
    return w


def _qwen3_moe_weights(spec: Qwen3MoeDemoSpec, vocab: int) -> Weights:
    init, h = _Init(spec.seed, spec.init_std), spec.hidden_size
    w = {"model.embed_tokens.weight": init.normal(vocab, h), "model.norm.weight": torch.ones(h)}
    w["lm_head.weight"] = init.normal(vocab, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        _attention(w, init, p + "self_attn.", h, spec.num_heads, spec.num_kv_heads,
                   spec.head_dim, gated=False, zero_centered=False)  # fmt: skip
        w[p + "mlp.gate.weight"] = init.normal(spec.num_experts, h)
        for e in range(spec.num_experts):
            _mlp(w, init, f"{p}mlp.experts.{e}.", h, spec.moe_intermediate_size)
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
    return w


def _qwen3_5_config(spec: Qwen3_5DemoSpec, tokens: DemoTokens) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "intermediate_size": spec.intermediate_size,
        "full_attention_interval": spec.full_attention_interval,
        "layer_types": [
            "linear_attention" if (i + 1) % spec.full_attention_interval else "full_attention"
            for i in range(spec.num_layers)
        ],
        "linear_num_key_heads": spec.linear_num_key_heads,
        "linear_num_value_heads": spec.linear_num_value_heads,
        "linear_key_head_dim": spec.linear_key_head_dim,
        "linear_value_head_dim": spec.linear_value_head_dim,
        "linear_conv_kernel_dim": spec.conv_kernel_size,
        # As the released Qwen3.5 checkpoints say: a server that reads it (vLLM) then keeps the
        # recurrent state in float32, as Tandem does; without it vLLM keeps it in the model's
        # dtype, and a benchmark would compare unlike work.
        "mamba_ssm_dtype": "float32",
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": spec.partial_rotary_factor,
        },
        "tie_word_embeddings": False,
    }


def _qwen3_moe_config(spec: Qwen3MoeDemoSpec, tokens: DemoTokens) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        # Dense MLP size, unused: every layer is sparse.
        "intermediate_size": 4 * spec.moe_intermediate_size,
        "num_experts": spec.num_experts,
        "num_experts_per_tok": spec.num_experts_per_tok,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "norm_topk_prob": spec.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    }


def _write(
    folder: str | Path,
    spec: Qwen3_5DemoSpec | Qwen3MoeDemoSpec,
    config: Callable[[Any, DemoTokens], dict[str, Any]],
    weights: Callable[[Any, int], Weights],
) -> Path:
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tokens = write_tokenizer(out, spec.vocab_size, spec.max_position_embeddings, spec.seed)
    full = {
        **config(spec, tokens),
        "vocab_size": tokens.vocab_size,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "bos_token_id": tokens.bos_token_id,
        "eos_token_id": tokens.eos_token_id,
        "dtype": "float32",
        "tandem_demo_spec": asdict(spec),
    }
    (out / "config.json").write_text(json.dumps(full, indent=2) + "\n", encoding="utf-8")
    tensors = weights(spec, tokens.vocab_size)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    logger.info(
        "wrote a %s demo model (%.1fM parameters) to %s",
        full["architectures"][0],
        sum(t.numel() for t in tensors.values()) / 1e6,
        out,
    )
    return out


def write_qwen3_5_demo_model(folder: str | Path, spec: Qwen3_5DemoSpec | None = None) -> Path:
    return _write(folder, spec or Qwen3_5DemoSpec(), _qwen3_5_config, _qwen3_5_weights)


def write_qwen3_moe_demo_model(folder: str | Path, spec: Qwen3MoeDemoSpec | None = None) -> Path:
    return _write(folder, spec or Qwen3MoeDemoSpec(), _qwen3_moe_config, _qwen3_moe_weights)
