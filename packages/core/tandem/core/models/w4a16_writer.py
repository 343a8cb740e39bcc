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
the group's top. Without calibration ``desc_act`` is false and ``g_idx`` the consecutive
groups; with it (``tandem quantize --calibration``), GPTQ itself (``gptq_solver.py``), but for
the modules without statistics (a routed expert no calibration token was routed to), which are
rounded to nearest and listed in the log.

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
    LINEAR_ATTENTION_PROJECTIONS,
    PROJECTIONS,
    SHARED_EXPERT_PROJECTIONS,
)
from tandem.core.models.gptq_config import GROUP_SIZES
from tandem.core.models.gptq_solver import gptq_quantize, quantize_gptq
from tandem.core.models.model_config import ModelConfig
from tandem.core.models.projection_match import DecoderLayout
from tandem.core.models.quantized_writer import (
    EXPERT_WEIGHT,
    PROJECTION_WEIGHT,
    decoder_layout,
    float_projections,
    layer_module,
    read_float_config,
    write_quantized,
)
from tandem.core.models.qwen3_family_config import Qwen3FamilyConfig

logger = logging.getLogger(__name__)

# AutoGPTQ's v1 format stores each zero point minus one.
_STORED_ZERO_OFFSET = 1


def gptq_tensors(
    name: str, weight: torch.Tensor, group_size: int, sym: bool
) -> dict[str, torch.Tensor]:
    """The GPTQ checkpoint tensors of the float ``weight`` named ``name`` (``....weight``),
    rounded to nearest."""
    codes, zeros, scales = quantize_gptq(weight, group_size, sym)
    columns = weight.shape[1]
    size = columns if group_size == -1 else group_size
    return packed_tensors(name, codes, zeros, scales, (torch.arange(columns) // size))


def packed_tensors(
    name: str,
    codes: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Codes [N, K], zero points and scales [N, G] and each input's group, as GPTQ stores
    them for the weight named ``name``."""
    prefix = name.removesuffix("weight")
    return {
        prefix + "qweight": pack_int4(codes.t(), dim=0),
        prefix + "qzeros": pack_int4((zeros - _STORED_ZERO_OFFSET).t(), dim=1),
        prefix + "scales": scales.t().contiguous(),
        prefix + "g_idx": g_idx.to(torch.int32),
    }


def projection_sizes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(outputs, inputs) of each decoder projection (a Qwen3.5's gated q_proj yields a gate
    beside each query; its linear-attention and shared-expert projections too)."""
    h, q = config.hidden_size, config.num_heads * config.head_dim
    kv, i = config.num_kv_heads * config.head_dim, config.intermediate_size
    gated = 2 if getattr(config, "gated_attention", False) else 1
    sizes = [(gated * q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]
    found = dict(zip(PROJECTIONS, sizes, strict=True))
    if isinstance(config, Qwen3FamilyConfig):
        key = config.linear_num_key_heads * config.linear_key_head_dim
        value = config.linear_num_value_heads * config.linear_value_head_dim
        heads = config.linear_num_value_heads
        linear = [(2 * key + value, h), (value, h), (heads, h), (heads, h), (h, value)]
        found.update(zip(LINEAR_ATTENTION_PROJECTIONS, linear, strict=True))
        s = config.shared_expert_intermediate_size
        found.update(zip(SHARED_EXPERT_PROJECTIONS, [(s, h), (s, h), (h, s)], strict=True))
    return found


def _expert_sizes(config: ModelConfig) -> list[tuple[int, int]]:
    """(outputs, inputs) of a routed expert's gate, up and down projections."""
    size = getattr(config, "moe_intermediate_size", 0)
    return [(size, config.hidden_size)] * 2 + [(config.hidden_size, size)]


def _existing(layout: DecoderLayout) -> frozenset[str]:
    """The modules (projections, ``EXPERTS``) some layer of ``layout`` has."""
    found = {p for i in range(layout.num_layers) for p in layout.projections(i)}
    return frozenset(found) | ({EXPERTS} if layout.has_experts else frozenset())


def storable_projections(
    config: ModelConfig,
    group_size: int,
    layout: DecoderLayout | None = None,
    keep_float: frozenset[str] = frozenset(),
) -> frozenset[str]:
    """The modules whose sizes GPTQ's packing holds (fused partners together, every routed
    expert projection or none) but those in ``keep_float``, and those no layer of ``layout``
    has."""
    layout = layout or DecoderLayout(config.num_layers)
    size = projection_sizes(config)

    def fits(rows: int, columns: int) -> bool:
        grouped = group_size == -1 or columns % group_size == 0
        return rows % PACK == 0 and columns % PACK == 0 and grouped

    existing = _existing(layout)
    chosen = {p for p in size if p in existing and p not in keep_float and fits(*size[p])}
    for fused in FUSED_PROJECTIONS:
        if not chosen.issuperset(fused):
            chosen.difference_update(fused)
    if layout.has_experts and all(fits(*s) for s in _expert_sizes(config)):
        chosen.add(EXPERTS)
    return frozenset(chosen) | (layout.all_quantizable() - _existing(layout))


def gptq_quantization_config(
    group_size: int,
    sym: bool,
    quantized: frozenset[str],
    layout: DecoderLayout | None = None,
    act_order: bool = False,
    calibrated: bool = False,
) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` as AutoGPTQ writes it, listing the 4-bit
    modules of ``layout`` (every routed expert projection by name) when some stay float."""
    config: dict[str, Any] = {
        "bits": 4,
        "checkpoint_format": "gptq",
        "damp_percent": 0.01,
        "desc_act": act_order,
        "group_size": group_size,
        "lm_head": False,
        "quant_method": "gptq",
        "static_groups": False,
        "sym": sym,
        # Calibrated, here on the float model's activations for every layer (calibration.py).
        "true_sequential": not calibrated,
    }
    layout = layout or DecoderLayout(1)
    if quantized != layout.all_quantizable():
        existing = _existing(layout)
        order = (*PROJECTIONS, *LINEAR_ATTENTION_PROJECTIONS, *SHARED_EXPERT_PROJECTIONS)
        listed: list[list[str]] = [[p for p in order if p in quantized & existing]]
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


def write_w4a16(
    src: Path,
    dst: Path,
    group_size: int = 128,
    sym: bool = True,
    hessians: dict[str, torch.Tensor] | None = None,
    act_order: bool = False,
    keep_float: frozenset[str] = frozenset(),
) -> int:
    """Write the GPTQ 4-bit copy of the float folder ``src`` into ``dst`` (new or empty);
    returns how many weights were quantized. With ``hessians`` (``calibration.py``, keyed by
    projection) the weights are quantized by GPTQ (``gptq_solver.py``), in activation order
    with ``act_order``; without, rounded to nearest. ``keep_float``: projections left float
    (``float_projections``)."""
    if act_order and hessians is None:
        raise ModelLoadError("activation order needs calibration statistics (GPTQ)")
    if group_size not in GROUP_SIZES:
        supported = ", ".join(map(str, GROUP_SIZES))
        raise ModelLoadError(f"group size {group_size} is not supported; supported: {supported}")
    config = read_float_config(src, "4-bit GPTQ")
    layout = decoder_layout(config)
    left_float = float_projections(keep_float, layout)
    quantized = storable_projections(config, group_size, layout, left_float)
    existing = _existing(layout)
    if not quantized & existing:
        raise ModelLoadError(
            f"no projection of {src} can be stored 4-bit with group size {group_size}: their "
            f"sizes must be multiples of {PACK} and their inputs of the group size"
        )
    sizes = {**projection_sizes(config), EXPERTS: _expert_sizes(config)}
    left = sorted(existing - quantized - left_float)
    if left:
        logger.warning(
            "quantize: %s stay float (sizes %s: not multiples of %d, or inputs not of the "
            "group size %d)",
            ", ".join(left),
            ", ".join(f"{p} {sizes[p]}" for p in left),
            PACK,
            group_size,
        )

    # With calibration: the projections rounded to nearest all the same (in order, once
    # each), and each layer's routed experts rounded to nearest (no token was routed to them).
    uncalibrated: dict[str, None] = {}
    unrouted: dict[str, set[str]] = {}

    def quantize(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor] | None:
        module = layer_module(name)
        if EXPERT_WEIGHT.match(name):
            if EXPERTS not in quantized:
                return None
        else:
            match = PROJECTION_WEIGHT.match(name)
            if match is None or match.group(1) not in quantized:
                return None
        if hessians is None:
            return gptq_tensors(name, weight, group_size, sym)
        hessian = hessians.get(module)
        # All zeros: no input ever reached it (GPTQ would zero every weight).
        if hessian is None or not bool(torch.diagonal(hessian).any()):
            if EXPERT_WEIGHT.match(name):
                experts, expert, _ = module.rsplit(".", 2)
                unrouted.setdefault(experts, set()).add(expert)
            else:
                uncalibrated[module] = None
            return gptq_tensors(name, weight, group_size, sym)
        codes, zeros, scales, g_idx = gptq_quantize(weight, hessian, group_size, sym, act_order)
        return packed_tensors(name, codes, zeros, scales, g_idx)

    metadata = gptq_quantization_config(
        group_size, sym, quantized, layout, act_order, calibrated=hessians is not None
    )
    count = write_quantized(src, dst, quantize, metadata)
    if hessians is not None and uncalibrated:
        logger.warning(
            "quantize: no calibration statistics for %d modules, rounded to nearest instead "
            "of GPTQ: %s",
            len(uncalibrated),
            ", ".join(uncalibrated),
        )
    if hessians is not None and unrouted:
        logger.warning(
            "quantize: no calibration token was routed to some experts (or their statistics "
            "did not fit in memory), rounded to nearest instead of GPTQ: %s",
            ", ".join(
                f"{experts} {len(left)} of {layout.num_experts}"
                for experts, left in unrouted.items()
            ),
        )
    logger.info("quantize: wrote %s (%d weights 4-bit GPTQ, group size %d)", dst, count, group_size)
    return count
