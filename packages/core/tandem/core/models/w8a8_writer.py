"""Write an INT8 W8A8 copy of a float Hugging Face folder, in the compressed-tensors
``int-quantized`` layout llm-compressor writes and vLLM reads (``tandem quantize``).

Every decoder projection's weight becomes int8 [out, in] with a ``weight_scale`` [out, 1] in
the checkpoint's dtype: round-to-nearest, symmetric, per output channel, with llm-compressor's
min-max scale (absmax / 127.5, so the most negative value may reach -128). Activations are
quantized per token at run time, so nothing is calibrated. Embeddings, norms and ``lm_head``
stay as they are; the tokenizer and generation files are copied. A mixture-of-experts model's
routed experts are quantized one by one like any projection; its routers stay float, listed
in ``ignore`` as llm-compressor's MoE recipes list them (``re:.*mlp.gate$``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from tandem.core.models.quantized_writer import (
    decoder_layout,
    read_float_config,
    write_quantized,
)

logger = logging.getLogger(__name__)

# The compressed-tensors release whose serialization this follows (its ``version`` field).
COMPRESSED_TENSORS_VERSION = "0.12.2"
_INT8_MIN, _INT8_MAX = -128, 127
# llm-compressor's symmetric scale: the absmax over half the int8 range (255 / 2).
_HALF_RANGE = (_INT8_MAX - _INT8_MIN) / 2
# The routers of a mixture-of-experts model, left float.
ROUTERS = "re:.*mlp.gate$"


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


def w8a8_quantization_config(routers: bool = False) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` as llm-compressor writes it for its W8A8
    scheme (int8 per-channel weights, dynamic per-token int8 activations); ``routers``: a
    mixture-of-experts model's, whose routers are ignored too."""
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
        "ignore": ["lm_head", ROUTERS] if routers else ["lm_head"],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": COMPRESSED_TENSORS_VERSION,
    }


def _quantize(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    q, scale = quantize_weight(weight)
    return {name: q, name.removesuffix("weight") + "weight_scale": scale}


def write_w8a8(src: Path, dst: Path) -> int:
    """Write the W8A8 copy of the float folder ``src`` into ``dst`` (new or empty); returns
    how many weights were quantized."""
    config = read_float_config(src, "int8 W8A8")
    routers = decoder_layout(config).has_experts
    quantized = write_quantized(src, dst, _quantize, w8a8_quantization_config(routers))
    logger.info("quantize: wrote %s (%d weights int8 W8A8)", dst, quantized)
    return quantized
