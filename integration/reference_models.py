"""Random checkpoints written by transformers itself, for checks of our models against the
reference implementation (logits, greedy tokens, topology equivalence).

A test helper, not part of the product: it sits on the test path (pytest's ``pythonpath``)
beside the end-to-end harness, for the core, integration and hardware suites alike."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from tandem.core.demo.demo_model import tiny_spec, write_demo_model

# Small linear-attention (Gated DeltaNet) and mixture-of-experts settings for the Qwen3.5 and
# MoE families (their config classes default to real sizes: head_dim 256, 128 experts).
HYBRID_SETTINGS: dict[str, Any] = {
    "head_dim": 32,
    # Every second layer full attention: two layers are one of each.
    "full_attention_interval": 2,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}
MOE_SETTINGS: dict[str, Any] = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}
# The vision tower of a ``*ForConditionalGeneration`` checkpoint: tiny, and skipped by us.
VISION_SETTINGS: dict[str, Any] = {
    "depth": 1,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "out_hidden_size": 64,
    "patch_size": 4,
    "temporal_patch_size": 1,
    "num_position_embeddings": 16,
}


def _family_settings(architecture: str) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    if architecture.startswith("Qwen3_5"):
        settings.update(HYBRID_SETTINGS)
    if "Moe" in architecture:
        settings.update(MOE_SETTINGS)
    return settings


def _config(architecture: str, settings: dict[str, Any]) -> Any:
    import transformers

    if architecture.endswith("ForConditionalGeneration"):
        composite = getattr(
            transformers, architecture.replace("ForConditionalGeneration", "Config")
        )
        return composite(text_config=settings, vision_config=VISION_SETTINGS)
    if architecture.startswith("Qwen3_5"):
        return getattr(transformers, architecture.replace("ForCausalLM", "TextConfig"))(**settings)
    return getattr(transformers, architecture.replace("ForCausalLM", "Config"))(**settings)


def write_reference_model(
    folder: Path,
    architecture: str,
    max_shard_size: str | None = None,
    seed: int = 0,
    fused_experts: bool = False,
    **overrides: Any,
) -> Any:
    """Save a random ``architecture`` model (HF layout, safetensors) with the tiny demo
    tokenizer into ``folder``; returns the transformers model. Weights have std 0.2, so greedy
    choices are decided by real margins, not by float rounding.

    Qwen3.5 and the MoE families get small linear-attention / expert settings (overridable);
    a ``*ForConditionalGeneration`` gets a tiny vision tower beside the text model (``overrides``
    go to its text config). ``fused_experts``: save experts as stacked tensors, as the
    Qwen3.5-MoE releases are, instead of one tensor per expert."""
    import transformers

    model_cls = getattr(transformers, architecture)
    settings: dict[str, Any] = {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "initializer_range": 0.2,
        "tie_word_embeddings": False,
        **_family_settings(architecture),
    }
    settings.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(_config(architecture, settings)).eval()
    family = architecture.startswith(("Qwen3_5", "Qwen3Moe"))
    if family:
        with torch.no_grad():
            # transformers starts norms at one (zero for zero-centred ones) and dt_bias at
            # one: move them, so that a wrong offset or a missed weight shows.
            for name, param in model.named_parameters():
                if param.ndim == 1 and "visual" not in name:
                    param.add_(torch.randn_like(param) * 0.3)
    folder.mkdir(parents=True, exist_ok=True)
    save: dict[str, Any] = {"save_original_format": not fused_experts} if family else {}
    if max_shard_size is not None:
        save["max_shard_size"] = max_shard_size
    model.save_pretrained(folder, **save)
    tokenizer_dir = folder / ".tokenizer"
    write_demo_model(tokenizer_dir, tiny_spec())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    shutil.rmtree(tokenizer_dir)
    return model
