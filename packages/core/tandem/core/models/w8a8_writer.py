"""Write an INT8 W8A8 copy of a float Hugging Face folder, in the compressed-tensors
``int-quantized`` layout llm-compressor writes and vLLM reads (``tandem quantize``).

Every decoder projection's weight becomes int8 [out, in] with a ``weight_scale`` [out, 1] in
the checkpoint's dtype: round-to-nearest, symmetric, per output channel, with llm-compressor's
min-max scale (absmax / 127.5, so the most negative value may reach -128). Activations are
quantized per token at run time, so nothing is calibrated. Embeddings, norms and ``lm_head``
stay as they are; the tokenizer and generation files are copied. A mixture-of-experts model's
routed experts are quantized one by one like any projection; its routers stay float, listed
in ``ignore`` as llm-compressor's MoE recipes list them (``re:.*mlp.gate$``), with a
Qwen3.5-MoE's shared-expert gates (``re:.*mlp.shared_expert_gate$``); projections kept float
(``keep_float``) are listed there too.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch

from tandem.core.errors import ModelLoadError
from tandem.core.layers.quant_scheme import EXPERTS
from tandem.core.models.projection_match import DecoderLayout
from tandem.core.models.quantized_writer import (
    PROJECTION_WEIGHT,
    decoder_layout,
    float_projections,
    read_float_config,
    write_quantized,
)

logger = logging.getLogger(__name__)

# The compressed-tensors release whose serialization this follows (its ``version`` field).
COMPRESSED_TENSORS_VERSION = "0.12.2"
_INT8_MIN, _INT8_MAX = -128, 127
# llm-compressor's symmetric scale: the absmax over half the int8 range (255 / 2).
_HALF_RANGE = (_INT8_MAX - _INT8_MIN) / 2
# The routers of a mixture-of-experts model, and the gates of its shared experts, left float.
ROUTERS = "re:.*mlp.gate$"
SHARED_EXPERT_GATES = "re:.*mlp.shared_expert_gate$"


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


def ignore_list(layout: DecoderLayout, keep_float: frozenset[str] = frozenset()) -> list[str]:
    """The modules a W8A8 checkpoint of ``layout`` leaves float: ``lm_head``, routers and
    shared-expert gates, and the projections in ``keep_float``, by llm-compressor's kind of
    entry (a regular expression anchored at the name's end)."""
    ignore = ["lm_head"]
    if layout.has_experts:
        ignore.append(ROUTERS)
    if layout.shared_expert:
        ignore.append(SHARED_EXPERT_GATES)
    ignore += [f"re:.*{re.escape(p)}$" for p in sorted(keep_float)]
    return ignore


def w8a8_quantization_config(
    routers: bool = False, ignore: list[str] | None = None
) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` as llm-compressor writes it for its W8A8
    scheme (int8 per-channel weights, dynamic per-token int8 activations); ``routers``: a
    mixture-of-experts model's, whose routers are ignored too; ``ignore``: the list in full,
    instead."""
    if ignore is None:
        ignore = ["lm_head", ROUTERS] if routers else ["lm_head"]
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
        "ignore": ignore,
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": COMPRESSED_TENSORS_VERSION,
    }


def write_w8a8(src: Path, dst: Path, keep_float: frozenset[str] = frozenset()) -> int:
    """Write the W8A8 copy of the float folder ``src`` into ``dst`` (new or empty); returns
    how many weights were quantized. ``keep_float``: projections left float
    (``float_projections``)."""
    config = read_float_config(src, "int8 W8A8")
    layout = decoder_layout(config)
    left = float_projections(keep_float, layout)
    if EXPERTS in left:
        # Every routed expert is written int8 below (the served W8A8 MoE path quantizes all
        # of them); an ignore entry for them would match no tensor and keep nothing float.
        raise ModelLoadError(
            "--keep-float: W8A8 writes every routed expert (mlp.experts) int8; to keep the "
            "experts float, leave them out of --keep-float or use --scheme w4a16"
        )

    def quantize(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor] | None:
        match = PROJECTION_WEIGHT.match(name)
        if match is not None and match.group(1) in left:
            return None
        q, scale = quantize_weight(weight)
        return {name: q, name.removesuffix("weight") + "weight_scale": scale}

    metadata = w8a8_quantization_config(ignore=ignore_list(layout, left))
    quantized = write_quantized(src, dst, quantize, metadata)
    logger.info("quantize: wrote %s (%d weights int8 W8A8)", dst, quantized)
    return quantized
