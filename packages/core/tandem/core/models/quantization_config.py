"""A ``config.json``'s ``quantization_config``: what we serve (compressed-tensors INT8 W8A8, the
``int-quantized`` format llm-compressor writes and vLLM reads; GPTQ and AWQ 4-bit weight-only,
read in ``gptq_config.py`` and ``awq_config.py``) and, for anything else, a refusal at
start-up that names the field and what is supported.

Supported for compressed-tensors: one config group targeting ``Linear``; weights int8,
symmetric, one scale per output channel; input activations int8, symmetric, either dynamic per
token or static per tensor (an ``input_scale`` per layer); ``lm_head`` ignored; decoder
projections quantized unless ``ignore`` names them (the same in every layer, fused partners
alike: a Qwen3.5 checkpoint may keep its linear-attention projections float, as
llm-compressor's Qwen3.5 recipes do with ``re:.*linear_attn.*``). In a mixture-of-experts
layer every routed expert's projections are quantized and the router (``mlp.gate``) and the
shared expert's gate (``mlp.shared_expert_gate``) are ignored, as llm-compressor's MoE recipes
write (``re:.*mlp.gate$``) and vLLM builds them (float). vLLM refuses static activation scales for
int8 MoE layers; we serve them, each expert with its own calibrated scale (gate and up at
their maximum, as a fused dense layer's parts).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from tandem.core.errors import ModelLoadError
from tandem.core.layers.quant_scheme import QuantScheme, W8A8Scheme
from tandem.core.models import awq_config, gptq_config
from tandem.core.models.projection_match import DecoderLayout, split_fused_group

QUANT_METHOD = "compressed-tensors"
INT_QUANTIZED = "int-quantized"
# The architectures whose quantized checkpoints are served (``CausalLM.SERVES_W8A8``).
SERVED_ARCHITECTURES = (
    "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, "
    "Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM (and their *ForConditionalGeneration text "
    "models)"
)
SUPPORTED = (
    "supported: compressed-tensors int8 W8A8 (format 'int-quantized'; weights 8-bit int "
    "symmetric per channel; activations 8-bit int symmetric, dynamic per token or static per "
    "tensor)"
)
_WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
_ACTIVATIONS = {"num_bits": 8, "type": "int", "symmetric": True}
# Activation schemes by (dynamic, strategy): whether the checkpoint has static input scales.
_ACTIVATION_STRATEGIES: dict[tuple[object, object], bool] = {
    (True, "token"): False,
    (False, "tensor"): True,
}


def _refuse(field: str, value: object, supported: str = SUPPORTED) -> ModelLoadError:
    return ModelLoadError(f"config.json: quantization_config.{field} is {value!r}; {supported}")


def parse_quantization(
    raw: Mapping[str, Any], architecture: str, serves_w8a8: bool, layout: DecoderLayout
) -> QuantScheme | None:
    """The scheme of the parsed ``config.json`` ``raw``; None for a float checkpoint.
    ``serves_w8a8``: whether the architecture's model builds quantized linear layers;
    ``layout``: the modules its decoder layers have."""
    config = raw.get("quantization_config")
    if config is None:
        return None
    if not isinstance(config, Mapping):
        raise _refuse("", config, "it must be an object")
    method = config.get("quant_method")
    if method not in (QUANT_METHOD, gptq_config.GPTQ, awq_config.AWQ):
        supported = f"{SUPPORTED}; {gptq_config.SUPPORTED}; {awq_config.SUPPORTED}"
        raise _refuse("quant_method", method, supported)
    if not serves_w8a8:
        raise ModelLoadError(
            f"config.json: quantized checkpoints of {architecture} are not supported; "
            f"int8 W8A8 and GPTQ/AWQ 4-bit are served for {SERVED_ARCHITECTURES}"
        )
    if method == gptq_config.GPTQ:
        return gptq_config.parse_gptq(config, layout)
    if method == awq_config.AWQ:
        return awq_config.parse_awq(config, layout)
    status = config.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse(
            "quantization_status", status, "supported: 'compressed' (int8 weights on disk)"
        )
    for empty in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if config.get(empty):
            raise _refuse(empty, config[empty], "supported: none (null or {})")
    groups = config.get("config_groups")
    if not isinstance(groups, Mapping) or len(groups) != 1:
        raise _refuse("config_groups", groups, "supported: exactly one group; " + SUPPORTED)
    [(name, group)] = groups.items()
    scheme = _parse_group(f"config_groups.{name}", group, config.get("format"))
    float_projections = _check_ignore(config.get("ignore") or [], layout)
    return replace(scheme, float_projections=float_projections)


def _parse_group(path: str, group: Any, top_format: object) -> W8A8Scheme:
    if not isinstance(group, Mapping):
        raise _refuse(path, group, "it must be an object")
    # A group's own format wins over the top-level one (which says "mixed-precision" when
    # groups differ).
    form, field = (
        (group["format"], f"{path}.format") if group.get("format") else (top_format, "format")
    )
    if form != INT_QUANTIZED:
        raise _refuse(field, form)
    targets = group.get("targets")
    if targets != ["Linear"]:
        raise _refuse(f"{path}.targets", targets, "supported: ['Linear']")
    if group.get("output_activations") is not None:
        raise _refuse(f"{path}.output_activations", group["output_activations"], SUPPORTED)
    weights = _args(f"{path}.weights", group.get("weights"), _WEIGHTS)
    if weights.get("dynamic", False) is not False:
        raise _refuse(f"{path}.weights.dynamic", weights["dynamic"])
    acts = _args(f"{path}.input_activations", group.get("input_activations"), _ACTIVATIONS)
    dynamic, strategy = acts.get("dynamic", False), acts.get("strategy")
    static = _ACTIVATION_STRATEGIES.get((dynamic, strategy))
    if static is None:
        raise _refuse(f"{path}.input_activations.strategy", strategy, _activation_help(dynamic))
    return W8A8Scheme(static=static)


def _activation_help(dynamic: object) -> str:
    return (
        f"with dynamic {dynamic!r}: supported are dynamic true with strategy 'token' and "
        "dynamic false with strategy 'tensor'"
    )


def _args(path: str, args: Any, required: Mapping[str, object]) -> Mapping[str, Any]:
    """Check one ``QuantizationArgs`` object against ``required``; grouping, blocks and
    activation ordering are refused (none of them has a meaning for per-channel int8)."""
    if not isinstance(args, Mapping):
        raise _refuse(path, args)
    for key, want in required.items():
        if args.get(key) != want:
            raise _refuse(f"{path}.{key}", args.get(key), f"supported: {want!r}; {SUPPORTED}")
    for key in ("group_size", "block_structure", "actorder"):
        value = args.get(key)
        if value not in (None, False, -1):
            raise _refuse(f"{path}.{key}", value, f"supported: null; {SUPPORTED}")
    return args


def _matches(target: str, name: str) -> bool:
    # compressed-tensors' rule: "re:" entries are regular expressions matched from the start
    # of the module name, others are exact module names (or class names, none of which is a
    # decoder projection's).
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


# Where a checkpoint keeps its decoder layers: a text model's, and a composite (vision and
# language) checkpoint's, whose ignore lists name its language model's modules.
_LAYER_PREFIXES = ("model.layers.", "model.language_model.layers.")


def _ignored_by(ignore: list[str], path: str) -> str | None:
    """The entry of ``ignore`` that leaves the module at ``path`` (``model.layers.3.x``)
    float, by its name in either kind of checkpoint."""
    tail = path.removeprefix(_LAYER_PREFIXES[0])
    names = [prefix + tail for prefix in _LAYER_PREFIXES]
    return next((t for t in ignore if any(_matches(t, n) for n in names)), None)


def _kind_of(gate: str) -> str:
    return "router" if gate.endswith(".mlp.gate") else "shared-expert gate"


def _check_ignore(ignore: list[str], layout: DecoderLayout) -> frozenset[str]:
    """The projections ``ignore`` leaves float (the same in every layer that has them, fused
    partners alike). The LM head, the routers and shared-expert gates must be left float;
    every routed expert must be quantized (experts built for int8 cannot take a float
    tensor)."""
    if not any(_matches(t, "lm_head") for t in ignore):
        raise _refuse("ignore", ignore, "supported: lists that include 'lm_head' (kept float)")
    float_in: dict[str, set[bool]] = {}
    for i in range(layout.num_layers):
        for p in layout.projections(i):
            float_in.setdefault(p, set()).add(
                _ignored_by(ignore, f"model.layers.{i}.{p}") is not None
            )
        for name in layout.expert_paths(i):
            hit = _ignored_by(ignore, name)
            if hit is not None:
                raise _refuse(
                    "ignore",
                    ignore,
                    f"its entry {hit!r} leaves {name} float; supported: every routed expert "
                    "quantized",
                )
        for gate in layout.always_float(i):
            if _ignored_by(ignore, gate) is None:
                raise _refuse(
                    "ignore",
                    ignore,
                    f"no entry leaves the {_kind_of(gate)} {gate} float; supported: lists "
                    "that ignore every router "
                    "and shared-expert gate (e.g. 're:.*mlp.gate$', "
                    "'re:.*mlp.shared_expert_gate$'), which are served float",
                )
    mixed = sorted(p for p, seen in float_in.items() if len(seen) > 1)
    if mixed:
        raise _refuse(
            "ignore",
            ignore,
            f"it leaves {mixed[0]} float in some layers only; supported: the same in every layer",
        )
    float_ones = frozenset(p for p, seen in float_in.items() if True in seen)
    fused = split_fused_group(frozenset(float_in) - float_ones)
    if fused is not None:
        raise _refuse(
            "ignore",
            ignore,
            f"supported: {', '.join(fused)} all int8 or all float (they run as one matmul)",
        )
    return float_ones
