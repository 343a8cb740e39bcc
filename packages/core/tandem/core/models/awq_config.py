"""An AWQ ``quantization_config`` (``quant_method: awq``, as AutoAWQ and transformers write it)
read into a ``W4A16Scheme`` with AWQ's layout, or refused at start-up naming the field.

Fields read as vLLM 0.32 reads them (``auto_awq.py`` ``from_config``): the bits from ``w_bit``
or ``bits``, the group size from ``q_group_size`` or ``group_size``, ``zero_point``,
``lm_head`` (a quantized LM head: refused here) and ``modules_to_not_convert`` (modules left
float; an entry leaves a projection float when it is a substring of its module path, as
vLLM's ``is_layer_skipped`` matches; a mixture-of-experts layer's routed experts stay float
when an entry is a substring of ``model.layers.{i}.mlp.experts``, vLLM's name of them, so
``gate`` leaves the router float, not the experts' ``gate_proj``; entries naming no decoder
projection, such as a vision tower, change nothing here). ``version`` must be ``gemm``, the
packing read here (AutoAWQ's GEMV and Marlin versions pack otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tandem.core.errors import ModelLoadError
from tandem.core.layers.quant_scheme import AWQ_LAYOUT, W4A16Scheme
from tandem.core.models.projection_match import (
    DecoderLayout,
    picked_projections,
    split_fused_group,
)

AWQ = "awq"
GROUP_SIZES = (32, 64, 128, -1)
SUPPORTED = (
    "supported: awq 4-bit weight-only (bits 4; group_size 32, 64, 128 or -1; zero_point true; "
    "version 'gemm'; lm_head not quantized)"
)


def _refuse(field: str, value: object, supported: str = SUPPORTED) -> ModelLoadError:
    return ModelLoadError(f"config.json: quantization_config.{field} is {value!r}; {supported}")


def _either(config: Mapping[str, Any], *fields: str) -> tuple[str, object]:
    """The first of ``fields`` present (AutoAWQ's name, then transformers'), and its value."""
    for field in fields:
        if field in config:
            return field, config[field]
    return fields[-1], None


def parse_awq(config: Mapping[str, Any], layout: DecoderLayout) -> W4A16Scheme:
    """The scheme of an AWQ ``quantization_config``."""
    field, bits = _either(config, "w_bit", "bits")
    if bits != 4:
        raise _refuse(field, bits)
    field, group_size = _either(config, "q_group_size", "group_size")
    if not isinstance(group_size, int) or group_size not in GROUP_SIZES:
        raise _refuse(field, group_size)
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("version", config.get("version"))
    if config.get("zero_point") is not True:
        raise _refuse("zero_point", config.get("zero_point"))
    if config.get("lm_head"):
        raise _refuse("lm_head", config["lm_head"])
    skipped = config.get("modules_to_not_convert") or []
    if not isinstance(skipped, list) or not all(isinstance(n, str) for n in skipped):
        raise _refuse("modules_to_not_convert", skipped, "supported: a list of names")
    float_ones = picked_projections(skipped, layout, experts_whole=True)
    if float_ones is None:
        raise _refuse("modules_to_not_convert", skipped, "supported: the same in every layer")
    quantized = layout.all_quantizable() - float_ones
    fused = split_fused_group(quantized)
    if fused is not None:
        raise _refuse(
            "modules_to_not_convert",
            skipped,
            f"supported: {', '.join(fused)} all 4-bit or all float (they run as one matmul)",
        )
    return W4A16Scheme(
        group_size=group_size, sym=False, desc_act=False, quantized=quantized, layout=AWQ_LAYOUT
    )
