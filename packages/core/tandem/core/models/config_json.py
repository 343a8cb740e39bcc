"""Read a Hugging Face ``config.json`` into the config class its architecture needs: the
family config for the Qwen3-MoE and Qwen3.5 families, the plain ``ModelConfig`` otherwise.

Apart from both classes because it picks between them and the family config subclasses the
plain one: the base class naming its subclass would make the two modules import each other.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from tandem.core.errors import ModelLoadError
from tandem.core.models.model_config import ModelConfig
from tandem.core.models.qwen3_family_config import FAMILY_ARCHITECTURES, parse_family_config


def parse_model_config(raw: dict[str, Any]) -> ModelConfig:
    """The config that the parsed ``config.json`` ``raw`` describes."""
    archs = raw.get("architectures") or []
    if not archs:
        raise ModelLoadError("config.json has no 'architectures' entry")
    arch = str(archs[0])
    try:
        if arch in FAMILY_ARCHITECTURES:
            return parse_family_config(raw, arch)
        return _parse_plain(raw, arch)
    except KeyError as exc:
        raise ModelLoadError(f"config.json lacks the required field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"config.json has a malformed field: {exc}") from None


def _parse_plain(raw: dict[str, Any], arch: str) -> ModelConfig:
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


def load_model_config(folder: Path) -> ModelConfig:
    """The config of the Hugging Face model folder ``folder``."""
    path = folder / "config.json"
    if not folder.is_dir():
        raise ModelLoadError(f"model folder {folder} does not exist")
    if not path.is_file():
        raise ModelLoadError(
            f"{folder} has no config.json; point --model at a Hugging Face model folder"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None
    config = parse_model_config(raw)
    # generation_config.json may name more end-of-sequence tokens than config.json.
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        try:
            gen = json.loads(gen_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            gen = {}
        eos = gen.get("eos_token_id")
        extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        merged = tuple(dict.fromkeys([*config.eos_token_ids, *map(int, extra)]))
        if merged != config.eos_token_ids:
            config = replace(config, eos_token_ids=merged)
    return config
