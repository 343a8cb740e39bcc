"""A GPTQ ``quantization_config`` (``quant_method: gptq``, as AutoGPTQ, GPTQModel and
transformers write it) read into a ``W4A16Scheme``, or refused at start-up naming the field.

Fields read as vLLM reads them (vLLM 0.32, ``auto_gptq.py`` ``from_config``): ``bits``,
``group_size``, ``desc_act``, ``sym``, ``lm_head`` (a quantized LM head: refused here),
``dynamic`` (GPTQModel's per-module overrides: its ``-:`` exclusions leave modules float,
and one that matches no module is warned of, which vLLM does not do; other overrides are
refused here) and
``modules_in_block_to_quantize`` (the projections stored 4-bit; the others float, matched as
vLLM matches them: an entry names a projection when it is a substring of its module path;
a mixture-of-experts layer's routed experts are 4-bit when an entry names them or one of
their projections, ``mlp.experts.3.gate_proj``: vLLM quantizes them whatever the list says,
which misreads a checkpoint that left them float).
Activation order with one group per channel changes nothing, so it is read as without (vLLM
does the same). Other fields (``damp_percent``, ``true_sequential``, ``static_groups``, ...)
describe how the weights were made, not how they are read.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from tandem.core.errors import ModelLoadError
from tandem.core.layers.quant_scheme import W4A16Scheme
from tandem.core.models.projection_match import (
    DecoderLayout,
    picked_projections,
    split_fused_group,
    unmatched_names,
)

logger = logging.getLogger(__name__)

GPTQ = "gptq"
# Modules served float whatever the config says, beside the decoder's routers and gates, that
# an exclusion may rightly name: Qwen's Qwen3.5 GPTQ releases write ``-:.*visual.*`` and
# ``-:.*mtp.*`` (the vision tower under vLLM's name and the checkpoint's, the
# multi-token-prediction head).
_FLOAT_ELSEWHERE = (
    "lm_head",
    "model.embed_tokens",
    "visual.blocks.0.attn.qkv",
    "model.visual.blocks.0.attn.qkv",
    "mtp.fc",
    "mtp.layers.0.self_attn.q_proj",
)
GROUP_SIZES = (32, 64, 128, -1)
SUPPORTED = (
    "supported: gptq 4-bit weight-only (bits 4; group_size 32, 64, 128 or -1; sym true or "
    "false; desc_act true or false; checkpoint_format 'gptq'; lm_head not quantized; "
    "'dynamic' only with '-:' exclusions)"
)


def _refuse(field: str, value: object, supported: str = SUPPORTED) -> ModelLoadError:
    return ModelLoadError(f"config.json: quantization_config.{field} is {value!r}; {supported}")


def _flag(config: Mapping[str, Any], field: str, default: bool) -> bool:
    value = config.get(field, default)
    if not isinstance(value, bool):
        raise _refuse(field, value, "supported: true or false")
    return value


def parse_gptq(config: Mapping[str, Any], layout: DecoderLayout) -> W4A16Scheme:
    """The scheme of a GPTQ ``quantization_config``."""
    bits = config.get("bits")
    if bits != 4:
        raise _refuse("bits", bits)
    group_size = config.get("group_size")
    if group_size not in GROUP_SIZES or isinstance(group_size, bool):
        raise _refuse("group_size", group_size)
    form = config.get("checkpoint_format", GPTQ)
    if form != GPTQ:
        raise _refuse("checkpoint_format", form)
    if config.get("lm_head"):
        raise _refuse("lm_head", config["lm_head"])
    sym = _flag(config, "sym", default=True)
    desc_act = _flag(config, "desc_act", default=False) and group_size != -1
    quantized = _quantized_projections(config.get("modules_in_block_to_quantize"), layout)
    quantized -= _dynamic_exclusions(config.get("dynamic") or {}, layout)
    fused = split_fused_group(quantized)
    if fused is not None:
        raise _refuse(
            "dynamic",
            config.get("dynamic"),
            f"supported: {', '.join(fused)} all 4-bit or all float (they run as one matmul)",
        )
    return W4A16Scheme(group_size=group_size, sym=sym, desc_act=desc_act, quantized=quantized)


def _dynamic_exclusions(dynamic: object, layout: DecoderLayout) -> frozenset[str]:
    """The modules GPTQModel's ``dynamic`` leaves float: its ``-:`` keys, regular expressions
    matched from the start of a module's path, as vLLM's ``get_dynamic_override`` matches
    them (Qwen's own Qwen3.5 GPTQ releases write ``-:.*attn.*``); per-module overrides of the
    bits or groups (``+:`` or unprefixed keys) are refused."""
    if not isinstance(dynamic, Mapping):
        raise _refuse("dynamic", dynamic, "supported: an object of '-:' regular expressions")
    patterns: dict[str, re.Pattern[str]] = {}
    for key in dynamic:
        if not isinstance(key, str) or not key.startswith("-:"):
            raise _refuse(
                "dynamic", dynamic, f"its key {key!r} overrides a module's scheme; " + SUPPORTED
            )
        patterns[key] = re.compile(key[2:])
    excluded: dict[str, set[bool]] = {}
    for i in range(layout.num_layers):
        for module, paths in layout.modules(i, experts_whole=True).items():
            hit = any(p.match(path) for p in patterns.values() for path in paths.split("\n"))
            excluded.setdefault(module, set()).add(hit)
    mixed = sorted(m for m, seen in excluded.items() if len(seen) > 1)
    if mixed:
        raise _refuse("dynamic", dynamic, f"it leaves {mixed[0]} float in some layers only")
    _warn_unmatched(patterns, layout)
    return frozenset(m for m, seen in excluded.items() if True in seen)


def _warn_unmatched(patterns: dict[str, re.Pattern[str]], layout: DecoderLayout) -> None:
    """Say which exclusions match no module: vLLM ignores them as silently as any other, and
    a typo there leaves 4-bit what its author meant float."""
    paths = [
        path
        for i in range(layout.num_layers)
        for found in (*layout.modules(i, experts_whole=True).values(), *layout.always_float(i))
        for path in found.split("\n")
    ]
    paths += _FLOAT_ELSEWHERE
    unmatched = [key for key, p in patterns.items() if not any(p.match(path) for path in paths)]
    if unmatched:
        logger.warning(
            "config.json: quantization_config.dynamic %s match no module of this model, so "
            "they leave nothing float; check them against its module names "
            "(model.layers.0.self_attn.q_proj, ...)",
            ", ".join(map(repr, unmatched)),
        )


def _flatten(entries: object) -> list[str]:
    if isinstance(entries, str):
        return [entries]
    if not isinstance(entries, list):
        raise _refuse("modules_in_block_to_quantize", entries, "supported: a list of names")
    return [name for entry in entries for name in _flatten(entry)]


def _quantized_projections(entries: object, layout: DecoderLayout) -> frozenset[str]:
    if entries is None or entries == []:
        return layout.all_quantizable()
    names = _flatten(entries)
    field = "modules_in_block_to_quantize"
    unmatched = unmatched_names(names, layout)
    if unmatched:
        supported = ", ".join(sorted(layout.all_quantizable()))
        raise _refuse(field, names, f"{unmatched[0]!r} names none of the supported {supported}")
    quantized = picked_projections(names, layout)
    if quantized is None:
        raise _refuse(field, names, "supported: the same projections in every layer")
    fused = split_fused_group(quantized)
    if fused is not None:
        raise _refuse(
            field,
            names,
            f"supported: {', '.join(fused)} all 4-bit or all float (they run as one matmul)",
        )
    return quantized
