"""Write an INT8 W8A8 copy of a float Hugging Face folder, in the compressed-tensors
``int-quantized`` layout llm-compressor writes and vLLM reads (``tandem quantize``).

Every decoder projection's weight becomes int8 [out, in] with a ``weight_scale`` [out, 1] in
the checkpoint's dtype: round-to-nearest, symmetric, per output channel, with llm-compressor's
min-max scale (absmax / 127.5, so the most negative value may reach -128). Activations are
quantized per token at run time, so nothing is calibrated. Embeddings, norms and ``lm_head``
stay as they are; the tokenizer and generation files are copied.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.core.errors import ModelLoadError
from tandem.core.models.config_json import load_model_config
from tandem.core.models.loader import weight_files
from tandem.core.models.registry import model_class

logger = logging.getLogger(__name__)

# The compressed-tensors release whose serialization this follows (its ``version`` field).
COMPRESSED_TENSORS_VERSION = "0.12.2"
_INT8_MIN, _INT8_MAX = -128, 127
# llm-compressor's symmetric scale: the absmax over half the int8 range (255 / 2).
_HALF_RANGE = (_INT8_MAX - _INT8_MIN) / 2
_PROJECTION = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$"
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


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] -> (int8 [out, in], scale [out, 1] in ``weight``'s dtype), with
    weight ~ q * scale; q is computed from the stored (rounded) scale, so dequantizing with it
    is exact to what was written."""
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / _HALF_RANGE).to(weight.dtype)
    # A zero row: compressed-tensors stores its dtype's epsilon, not a zero scale.
    scale = torch.where(scale == 0, torch.finfo(weight.dtype).eps, scale)
    q = torch.round(w / scale.float()).clamp_(_INT8_MIN, _INT8_MAX).to(torch.int8)
    return q, scale


def _args(strategy: str, dynamic: bool) -> dict[str, Any]:
    """One ``QuantizationArgs`` as compressed-tensors serializes it (symmetric int8)."""
    return {
        "actorder": None,
        "block_structure": None,
        "dynamic": dynamic,
        "group_size": None,
        "num_bits": 8,
        # Dynamic quantization has no observer; static weights use the min-max one.
        "observer": None if dynamic else "minmax",
        "observer_kwargs": {},
        "scale_dtype": None,
        "strategy": strategy,
        "symmetric": True,
        "type": "int",
        "zp_dtype": None,
    }


def w8a8_quantization_config() -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` as llm-compressor writes it for its W8A8
    scheme (int8 per-channel weights, dynamic per-token int8 activations)."""
    return {
        "config_groups": {
            "group_0": {
                "format": "int-quantized",
                "input_activations": _args("token", dynamic=True),
                "output_activations": None,
                "targets": ["Linear"],
                "weights": _args("channel", dynamic=False),
            }
        },
        "format": "int-quantized",
        "global_compression_ratio": None,
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": COMPRESSED_TENSORS_VERSION,
    }


def write_w8a8(src: Path, dst: Path) -> int:
    """Write the W8A8 copy of the float folder ``src`` into ``dst`` (new or empty); returns
    how many weights were quantized."""
    config = load_model_config(src)
    raw = json.loads((src / "config.json").read_text(encoding="utf-8"))
    if "quantization_config" in raw:
        raise ModelLoadError(
            f"{src} is already quantized (its config.json has quantization_config)"
        )
    if not model_class(config.architecture).SERVES_W8A8:
        raise ModelLoadError(
            f"{config.architecture} cannot be served int8 W8A8; supported: LlamaForCausalLM, "
            "Qwen2ForCausalLM, Qwen3ForCausalLM"
        )
    if dst.exists() and any(dst.iterdir()):
        raise ModelLoadError(f"{dst} is not empty; give a new folder")
    dst.mkdir(parents=True, exist_ok=True)
    files = weight_files(src)
    placed: dict[str, str] = {}
    quantized = total_bytes = 0
    for number, path in enumerate(files, 1):
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not dicts
                tensor = handle.get_tensor(name)
                if _PROJECTION.match(name):
                    q, scale = quantize_weight(tensor)
                    tensors[name] = q
                    tensors[name.removesuffix("weight") + "weight_scale"] = scale
                    quantized += 1
                else:
                    tensors[name] = tensor
        save_file(tensors, str(dst / path.name), metadata={"format": "pt"})
        placed.update(dict.fromkeys(tensors, path.name))
        total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        logger.info(
            "quantize: %s (%d of %d files), %d weights int8 so far",
            path.name,
            number,
            len(files),
            quantized,
        )
    if quantized == 0:
        raise ModelLoadError(f"{src} has no decoder projection weights to quantize")
    _write_index(src, dst, placed, total_bytes)
    raw["quantization_config"] = w8a8_quantization_config()
    # As compressed-tensors writes it: sorted keys, two-space indent.
    (dst / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True), encoding="utf-8")
    for pattern in _COPIED:
        for extra in src.glob(pattern):
            if extra.is_file():
                shutil.copy2(extra, dst / extra.name)
    logger.info("quantize: wrote %s (%d weights int8 W8A8)", dst, quantized)
    return quantized


def _write_index(src: Path, dst: Path, placed: dict[str, str], total_bytes: int) -> None:
    name = "model.safetensors.index.json"
    if (src / name).is_file():
        index = {
            "metadata": {"total_size": total_bytes},
            "weight_map": dict(sorted(placed.items())),
        }
        (dst / name).write_text(json.dumps(index, indent=2), encoding="utf-8")
