"""Write a quantized copy of a float Hugging Face folder (``tandem quantize``): every decoder
projection weight the scheme quantizes, routed experts' included, is replaced by the tensors
its format stores; embeddings, norms, biases, routers and ``lm_head`` stay as they are; the
tokenizer and generation files are copied and ``config.json`` gains the scheme's
``quantization_config``.

A projection kept float (``--keep-float``, e.g. a Qwen3.5's linear-attention ones) is left as
it is, and the written config says so in the way its format does.

Routed experts stacked in one tensor per layer (``experts.gate_up_proj`` [E, 2 I, H],
``experts.down_proj`` [E, H, I], as transformers 5 may save Qwen3-MoE) are written one expert
at a time (``experts.{e}.gate_proj.weight`` ...), the names quantized checkpoints use.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.core.errors import ModelLoadError
from tandem.core.layers.quant_scheme import FUSED_PROJECTIONS
from tandem.core.models.config_json import load_model_config
from tandem.core.models.loader import weight_files
from tandem.core.models.model_config import ModelConfig
from tandem.core.models.projection_match import DecoderLayout
from tandem.core.models.quantization_config import SERVED_ARCHITECTURES
from tandem.core.models.registry import model_class

logger = logging.getLogger(__name__)

# Where a checkpoint keeps its decoder layers (a composite checkpoint under its language model).
_LAYERS = r"^model\.(?:language_model\.)?layers\.\d+\."
_COMPOSITE = "model.language_model."
# A decoder projection's weight; group 1 is its name within the layer (``self_attn.q_proj``).
PROJECTION_WEIGHT = re.compile(
    _LAYERS + r"(self_attn\.[qkvo]_proj|mlp\.(?:shared_expert\.)?(?:gate|up|down)_proj"
    r"|linear_attn\.(?:in_proj_(?:qkv|z|b|a)|out_proj))\.weight$"
)
# A routed expert's projection weight (``model.layers.3.mlp.experts.7.up_proj.weight``).
EXPERT_WEIGHT = re.compile(_LAYERS + r"mlp\.experts\.\d+\.(?:gate|up|down)_proj\.weight$")
# A layer's routed experts stacked in one tensor; group 1 is the experts' module.
_STACKED_EXPERTS = re.compile(
    r"^(model\.(?:language_model\.)?layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$"
)
# Files beside the weights that a served folder needs.
_COPIED = (
    "tokenizer*",
    "*.model",
    "vocab*",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template*",
    "generation_config.json",
)
# A projection's checkpoint name and float weight -> the tensors stored instead (named in
# full), or None to keep it float.
Quantize = Callable[[str, torch.Tensor], dict[str, torch.Tensor] | None]


def read_float_config(src: Path, scheme: str) -> ModelConfig:
    """The config of ``src``, refused when it is quantized already or the architecture does
    not serve quantized checkpoints."""
    config = load_model_config(src)
    raw = json.loads((src / "config.json").read_text(encoding="utf-8"))
    if "quantization_config" in raw:
        raise ModelLoadError(
            f"{src} is already quantized (its config.json has quantization_config)"
        )
    if not model_class(config.architecture).SERVES_W8A8:
        raise ModelLoadError(
            f"{config.architecture} cannot be served {scheme}; supported: {SERVED_ARCHITECTURES}"
        )
    return config


def decoder_layout(config: ModelConfig) -> DecoderLayout:
    """Which quantizable modules the layers of ``config``'s model have."""
    return model_class(config.architecture).decoder_layout(config)


def float_projections(names: frozenset[str], layout: DecoderLayout) -> frozenset[str]:
    """The projections ``names`` (each a projection, or a part of its name that picks it:
    ``linear_attn`` picks the five of a Gated DeltaNet) ask to keep float, with their fused
    partners; refused when one picks none."""
    quantizable = layout.all_quantizable()
    chosen: set[str] = set()
    for name in names:
        picked = {p for p in quantizable if name in p}
        if not picked:
            supported = ", ".join(sorted(quantizable))
            raise ModelLoadError(f"--keep-float {name!r} names none of {supported}")
        chosen |= picked
    for fused in FUSED_PROJECTIONS:
        if chosen.intersection(fused):
            chosen.update(fused)
    return frozenset(chosen)


def layer_module(name: str) -> str:
    """The module path of the decoder tensor ``name`` (``....weight``) as the model names it
    (``model.layers.3.self_attn.q_proj``), whether or not the checkpoint nests its layers
    under a language model."""
    module = name.removesuffix(".weight")
    if module.startswith(_COMPOSITE):
        return "model." + module.removeprefix(_COMPOSITE)
    return module


def _one_by_one(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A checkpoint tensor, or a layer's stacked experts as one tensor per expert."""
    stacked = _STACKED_EXPERTS.match(name)
    if stacked is None:
        return {name: tensor}
    prefix, kind = stacked.groups()
    if kind == "down_proj":
        return {f"{prefix}.{e}.down_proj.weight": w.clone() for e, w in enumerate(tensor)}
    size = tensor.shape[1] // 2
    out: dict[str, torch.Tensor] = {}
    for e, w in enumerate(tensor):
        out[f"{prefix}.{e}.gate_proj.weight"] = w[:size].clone()
        out[f"{prefix}.{e}.up_proj.weight"] = w[size:].clone()
    return out


def write_quantized(
    src: Path, dst: Path, quantize: Quantize, quantization_config: dict[str, Any]
) -> int:
    """Write the copy of the float folder ``src`` into ``dst`` (new or empty); returns how many
    weights were quantized."""
    if dst.exists() and any(dst.iterdir()):
        raise ModelLoadError(f"{dst} is not empty; give a new folder")
    dst.mkdir(parents=True, exist_ok=True)
    files = weight_files(src)
    placed: dict[str, str] = {}
    quantized = total_bytes = 0
    for number, path in enumerate(files, 1):
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt") as handle:
            for stored in handle.keys():  # noqa: SIM118 - safe_open handles are not dicts
                expert_by_expert = _one_by_one(stored, handle.get_tensor(stored))
                for name, tensor in expert_by_expert.items():
                    weight = PROJECTION_WEIGHT.match(name) or EXPERT_WEIGHT.match(name)
                    written = quantize(name, tensor) if weight else None
                    if written is None:
                        tensors[name] = tensor
                    else:
                        tensors.update(written)
                        quantized += 1
        save_file(tensors, str(dst / path.name), metadata={"format": "pt"})
        placed.update(dict.fromkeys(tensors, path.name))
        total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        logger.info(
            "quantize: %s (%d of %d files), %d weights quantized so far",
            path.name,
            number,
            len(files),
            quantized,
        )
    if quantized == 0:
        raise ModelLoadError(f"{src} has no decoder projection weights to quantize")
    _write_index(src, dst, placed, total_bytes)
    raw = json.loads((src / "config.json").read_text(encoding="utf-8"))
    raw["quantization_config"] = quantization_config
    # As compressed-tensors and transformers write it: sorted keys, two-space indent.
    (dst / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True), encoding="utf-8")
    for pattern in _COPIED:
        for extra in src.glob(pattern):
            if extra.is_file():
                shutil.copy2(extra, dst / extra.name)
    return quantized


def _write_index(src: Path, dst: Path, placed: dict[str, str], total_bytes: int) -> None:
    name = "model.safetensors.index.json"
    if (src / name).is_file():
        index = {
            "metadata": {"total_size": total_bytes},
            "weight_map": dict(sorted(placed.items())),
        }
        (dst / name).write_text(json.dumps(index, indent=2), encoding="utf-8")
