"""Write a 4-bit weight-only (W4A16) copy of a float Hugging Face folder in GPTQ's format
(``checkpoint_format: gptq``, the tensors AutoGPTQ writes and vLLM reads; the layout is in
``kernels/reference/int4_packing.py``), for ``tandem quantize --scheme w4a16``.

Round to nearest, per group of ``group_size`` inputs (-1: one group per output channel), with
GPTQ's quantizer (``quant.py`` of IST-DASLab/gptq, which AutoGPTQ keeps): the range spans
[min(w, 0), max(w, 0)] (symmetric: [-absmax, absmax]) over 15 steps; the zero point is 8 when
symmetric, else ``round(-min / scale)``; code = clamp(round(w / scale) + zero, 0, 15). Codes are
computed from the stored float16 scale, so dequantizing is exact to what was written. This
format stores a zero point minus one in four bits, so an asymmetric zero point of 0 (a group
with no negative weight) cannot be stored: it is raised to 1, at most one step of clipping at
the group's top. No calibration: ``desc_act`` is false, ``g_idx`` the consecutive groups.

A projection whose sizes the format cannot hold (inputs or outputs not a multiple of 8, inputs
not a multiple of the group size) stays float, with its fused partners, in every layer; the
others are listed in ``modules_in_block_to_quantize``, the field vLLM and transformers read.
A mixture-of-experts model's routed experts are quantized one by one, all of them or (sizes
the format cannot hold) none; its routers stay float.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from tandem.core.errors import ModelLoadError
from tandem.core.kernels.reference.int4_packing import PACK, pack_int4
from tandem.core.layers.quant_scheme import (
    EXPERT_PROJECTIONS,
    EXPERTS,
    FUSED_PROJECTIONS,
    PROJECTIONS,
)
from tandem.core.models.gptq_config import GROUP_SIZES
from tandem.core.models.model_config import ModelConfig
from tandem.core.models.projection_match import DecoderLayout
from tandem.core.models.quantized_writer import (
    EXPERT_WEIGHT,
    PROJECTION_WEIGHT,
    decoder_layout,
    read_float_config,
    write_quantized,
)

logger = logging.getLogger(__name__)

_MAX_CODE = 15
_SYMMETRIC_ZERO = 8
# AutoGPTQ's v1 format stores each zero point minus one.
_STORED_ZERO_OFFSET = 1
_SCALE_DTYPE = torch.float16


def quantize_gptq(
    weight: torch.Tensor, group_size: int, sym: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] -> (codes uint8 [N, K], zero points uint8 [N, G], float16 scales
    [N, G]) with weight ~ (code - zero) * scale of the input's group."""
    rows, columns = weight.shape
    size = columns if group_size == -1 else group_size
    w = weight.double().view(rows, columns // size, size)
    low = w.amin(-1).clamp(max=0)
    high = w.amax(-1).clamp(min=0)
    if sym:
        high = torch.maximum(-low, high)
        low = -high
    # An all-zero group: GPTQ's quantizer widens it to [-1, 1].
    empty = (low == 0) & (high == 0)
    low, high = low.masked_fill(empty, -1), high.masked_fill(empty, 1)
    tiny = torch.finfo(_SCALE_DTYPE).tiny
    scales = ((high - low) / _MAX_CODE).clamp(min=tiny).to(_SCALE_DTYPE)
    s = scales.double()
    if sym:
        zeros = torch.full_like(s, _SYMMETRIC_ZERO)
    else:
        zeros = torch.round(-low / s).clamp(_STORED_ZERO_OFFSET, _MAX_CODE)
    codes = torch.round(w / s.unsqueeze(-1)) + zeros.unsqueeze(-1)
    codes = codes.clamp(0, _MAX_CODE).view(rows, columns)
    return codes.to(torch.uint8), zeros.to(torch.uint8), scales


def gptq_tensors(
    name: str, weight: torch.Tensor, group_size: int, sym: bool
) -> dict[str, torch.Tensor]:
    """The GPTQ checkpoint tensors of the float ``weight`` named ``name`` (``....weight``)."""
    codes, zeros, scales = quantize_gptq(weight, group_size, sym)
    columns = weight.shape[1]
    size = columns if group_size == -1 else group_size
    prefix = name.removesuffix("weight")
    return {
        prefix + "qweight": pack_int4(codes.t(), dim=0),
        prefix + "qzeros": pack_int4((zeros - _STORED_ZERO_OFFSET).t(), dim=1),
        prefix + "scales": scales.t().contiguous(),
        prefix + "g_idx": (torch.arange(columns) // size).to(torch.int32),
    }


def projection_sizes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(outputs, inputs) of each decoder projection."""
    h, q = config.hidden_size, config.num_heads * config.head_dim
    kv, i = config.num_kv_heads * config.head_dim, config.intermediate_size
    sizes = [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]
    return dict(zip(PROJECTIONS, sizes, strict=True))


def _expert_sizes(config: ModelConfig) -> list[tuple[int, int]]:
    """(outputs, inputs) of a routed expert's gate, up and down projections."""
    size = getattr(config, "moe_intermediate_size", 0)
    return [(size, config.hidden_size)] * 2 + [(config.hidden_size, size)]


def _existing(layout: DecoderLayout) -> frozenset[str]:
    """The modules (projections, ``EXPERTS``) some layer of ``layout`` has."""
    found = {p for i in range(layout.num_layers) for p in layout.projections(i)}
    return frozenset(found) | ({EXPERTS} if layout.has_experts else frozenset())


def storable_projections(
    config: ModelConfig, group_size: int, layout: DecoderLayout | None = None
) -> frozenset[str]:
    """The modules whose sizes GPTQ's packing holds (fused partners together, every routed
    expert projection or none), and those no layer of ``layout`` has."""
    layout = layout or DecoderLayout(config.num_layers)
    size = projection_sizes(config)

    def fits(rows: int, columns: int) -> bool:
        grouped = group_size == -1 or columns % group_size == 0
        return rows % PACK == 0 and columns % PACK == 0 and grouped

    chosen = {p for p in PROJECTIONS if fits(*size[p])}
    for fused in FUSED_PROJECTIONS:
        if not chosen.issuperset(fused):
            chosen.difference_update(fused)
    if layout.has_experts and all(fits(*s) for s in _expert_sizes(config)):
        chosen.add(EXPERTS)
    return frozenset(chosen) | (layout.all_quantizable() - _existing(layout))


def gptq_quantization_config(
    group_size: int, sym: bool, quantized: frozenset[str], layout: DecoderLayout | None = None
) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` as AutoGPTQ writes it for round-to-nearest
    weights (no activation order), listing the 4-bit modules of ``layout`` (every routed
    expert projection by name) when some stay float."""
    config: dict[str, Any] = {
        "bits": 4,
        "checkpoint_format": "gptq",
        "damp_percent": 0.01,
        "desc_act": False,
        "group_size": group_size,
        "lm_head": False,
        "quant_method": "gptq",
        "static_groups": False,
        "sym": sym,
        "true_sequential": True,
    }
    layout = layout or DecoderLayout(1)
    if quantized != layout.all_quantizable():
        existing = _existing(layout)
        listed: list[list[str]] = [[p for p in PROJECTIONS if p in quantized & existing]]
        if EXPERTS in quantized & existing:
            listed.append(
                [
                    f"{EXPERTS}.{e}.{p}"
                    for e in range(layout.num_experts)
                    for p in EXPERT_PROJECTIONS
                ]
            )
        config["modules_in_block_to_quantize"] = listed
    return config


def write_w4a16(src: Path, dst: Path, group_size: int = 128, sym: bool = True) -> int:
    """Write the GPTQ 4-bit copy of the float folder ``src`` into ``dst`` (new or empty);
    returns how many weights were quantized."""
    if group_size not in GROUP_SIZES:
        supported = ", ".join(map(str, GROUP_SIZES))
        raise ModelLoadError(f"group size {group_size} is not supported; supported: {supported}")
    config = read_float_config(src, "4-bit GPTQ")
    layout = decoder_layout(config)
    quantized = storable_projections(config, group_size, layout)
    existing = _existing(layout)
    if not quantized & existing:
        raise ModelLoadError(
            f"no projection of {src} can be stored 4-bit with group size {group_size}: their "
            f"sizes must be multiples of {PACK} and their inputs of the group size"
        )
    sizes = {**projection_sizes(config), EXPERTS: _expert_sizes(config)}
    left = [p for p in (*PROJECTIONS, EXPERTS) if p in existing - quantized]
    if left:
        logger.warning(
            "quantize: %s stay float (sizes %s: not multiples of %d, or inputs not of the "
            "group size %d)",
            ", ".join(left),
            ", ".join(f"{p} {sizes[p]}" for p in left),
            PACK,
            group_size,
        )

    def quantize(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if EXPERT_WEIGHT.match(name):
            return gptq_tensors(name, weight, group_size, sym) if EXPERTS in quantized else None
        match = PROJECTION_WEIGHT.match(name)
        if match is None or match.group(1) not in quantized:
            return None
        return gptq_tensors(name, weight, group_size, sym)

    metadata = gptq_quantization_config(group_size, sym, quantized, layout)
    count = write_quantized(src, dst, quantize, metadata)
    logger.info("quantize: wrote %s (%d weights 4-bit GPTQ, group size %d)", dst, count, group_size)
    return count
