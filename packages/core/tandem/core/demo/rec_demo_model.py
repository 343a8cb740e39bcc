"""A small random generative recommender in the folder layout ``tandem serve`` reads:
config.json, model.safetensors (fixed-seed weights under their checkpoint names) and
catalog.safetensors (the items, unique semantic-id tuples)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from tandem.core.models.rec_config import RecModelConfig
from tandem.core.rec.catalog import CATALOG_FILE


@dataclass(frozen=True)
class RecDemoSpec:
    num_codebooks: int = 3
    codebook_size: int = 256
    hidden_size: int = 256
    num_heads: int = 8
    head_dim: int = 32
    intermediate_size: int = 1024
    num_encoder_layers: int = 4
    num_decoder_layers: int = 4
    max_history: int = 256
    num_items: int = 50000
    beam_width: int = 16
    seed: int = 0

    def config(self) -> RecModelConfig:
        return RecModelConfig(
            num_codebooks=self.num_codebooks,
            codebook_size=self.codebook_size,
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            num_encoder_layers=self.num_encoder_layers,
            num_decoder_layers=self.num_decoder_layers,
            max_history=self.max_history,
            beam_width=self.beam_width,
        )


def tiny_rec_spec() -> RecDemoSpec:
    """Small enough for tests: every step in milliseconds."""
    return RecDemoSpec(
        hidden_size=32, num_heads=4, head_dim=8, intermediate_size=64, max_history=32,
        num_items=300, codebook_size=16, beam_width=8,
    )  # fmt: skip


def _weights(spec: RecDemoSpec, gen: torch.Generator) -> dict[str, torch.Tensor]:
    h, width = spec.hidden_size, spec.num_heads * spec.head_dim

    def rand(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    def attention(prefix: str) -> dict[str, torch.Tensor]:
        return {
            f"{prefix}.q_proj.weight": rand(width, h, scale=h**-0.5),
            f"{prefix}.k_proj.weight": rand(width, h, scale=h**-0.5),
            f"{prefix}.v_proj.weight": rand(width, h, scale=h**-0.5),
            f"{prefix}.o_proj.weight": rand(h, width, scale=width**-0.5),
        }

    def mlp(prefix: str) -> dict[str, torch.Tensor]:
        i = spec.intermediate_size
        return {
            f"{prefix}.gate_proj.weight": rand(i, h, scale=h**-0.5),
            f"{prefix}.up_proj.weight": rand(i, h, scale=h**-0.5),
            f"{prefix}.down_proj.weight": rand(h, i, scale=i**-0.5),
        }

    w: dict[str, torch.Tensor] = {}
    for c in range(spec.num_codebooks):
        w[f"encoder.item_embeddings.{c}.weight"] = rand(spec.codebook_size, h, scale=1.0)
        w[f"decoder.code_embeddings.{c}.weight"] = rand(spec.codebook_size, h, scale=1.0)
        w[f"decoder.heads.{c}.weight"] = rand(spec.codebook_size, h, scale=h**-0.5)
    w["encoder.position_embeddings.weight"] = rand(spec.max_history, h, scale=0.5)
    w["decoder.position_embeddings.weight"] = rand(spec.num_codebooks, h, scale=0.5)
    w["decoder.bos_embedding.weight"] = rand(1, h, scale=1.0)
    for i in range(spec.num_encoder_layers):
        p = f"encoder.layers.{i}"
        w.update(attention(f"{p}.self_attn"))
        w.update(mlp(f"{p}.mlp"))
        w[f"{p}.input_layernorm.weight"] = torch.ones(h)
        w[f"{p}.post_attention_layernorm.weight"] = torch.ones(h)
    for i in range(spec.num_decoder_layers):
        p = f"decoder.layers.{i}"
        w.update(attention(f"{p}.self_attn"))
        w.update(attention(f"{p}.cross_attn"))
        w.update(mlp(f"{p}.mlp"))
        for norm in ("input_layernorm", "cross_attention_layernorm", "post_attention_layernorm"):
            w[f"{p}.{norm}.weight"] = torch.ones(h)
    w["encoder.norm.weight"] = torch.ones(h)
    w["decoder.norm.weight"] = torch.ones(h)
    return w


def _catalog(spec: RecDemoSpec, gen: torch.Generator) -> torch.Tensor:
    space = spec.codebook_size**spec.num_codebooks
    count = min(spec.num_items, space)
    keys = torch.randperm(space, generator=gen)[:count].sort().values
    digits = []
    for _ in range(spec.num_codebooks):
        digits.append(keys % spec.codebook_size)
        keys = keys // spec.codebook_size
    return torch.stack(digits[::-1], dim=1).to(torch.int64)


def write_rec_demo_model(folder: Path, spec: RecDemoSpec | None = None) -> Path:
    spec = spec or RecDemoSpec()
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(spec.seed)
    weights = {k: v.contiguous() for k, v in sorted(_weights(spec, gen).items())}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    save_file({"items": _catalog(spec, gen)}, str(folder / CATALOG_FILE))
    config = spec.config().to_dict()
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return folder
