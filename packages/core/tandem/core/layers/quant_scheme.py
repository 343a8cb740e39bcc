"""How a checkpoint's linear layers are quantized, as the layers are built with it (parsed from
``config.json`` by ``models/quantization_config.py``)."""

from __future__ import annotations

from dataclasses import dataclass

# A dense decoder layer's projections, by their names in the checkpoint.
PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
# A Gated DeltaNet (linear-attention) layer's projections, which replace attention's there.
LINEAR_ATTENTION_PROJECTIONS = (
    "linear_attn.in_proj_qkv",
    "linear_attn.in_proj_z",
    "linear_attn.in_proj_b",
    "linear_attn.in_proj_a",
    "linear_attn.out_proj",
)
# A mixture-of-experts layer's shared expert (Qwen3.5-MoE); its gate
# (``mlp.shared_expert_gate``), like the router, is always float, as vLLM builds it.
SHARED_EXPERT_PROJECTIONS = (
    "mlp.shared_expert.gate_proj",
    "mlp.shared_expert.up_proj",
    "mlp.shared_expert.down_proj",
)
# The checkpoint projections each of our fused layers computes in one matmul (vLLM fuses the
# same: ``in_proj_qkvz`` and ``in_proj_ba``).
FUSED_PROJECTIONS = (
    PROJECTIONS[:3],
    PROJECTIONS[4:6],
    LINEAR_ATTENTION_PROJECTIONS[:2],
    LINEAR_ATTENTION_PROJECTIONS[2:4],
    SHARED_EXPERT_PROJECTIONS[:2],
)
# A mixture-of-experts layer's routed experts (``mlp.experts.{e}.gate_proj`` ...), quantized
# all alike or not at all; its router (``mlp.gate``) is always float, as vLLM builds it.
EXPERTS = "mlp.experts"
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class W8A8Scheme:
    """int8 symmetric weights with one scale per output channel; activations int8 symmetric,
    per token at run time (``static`` False) or with a calibrated per-tensor ``input_scale``
    (True). ``float_projections``: the projections the checkpoint keeps float (its ``ignore``
    list), the same in every layer that has them."""

    static: bool
    float_projections: frozenset[str] = frozenset()


# The two 4-bit checkpoint layouts (``kernels/reference/int4_packing.py``).
GPTQ_LAYOUT = "gptq"
AWQ_LAYOUT = "awq"


@dataclass(frozen=True)
class W4A16Scheme:
    """4-bit weights, activations float: ``group_size`` inputs share a scale and zero point
    (-1: one group per output channel); ``sym``: every zero point is 8; ``desc_act``: inputs
    were quantized in activation order (each input's group is in ``g_idx``). ``quantized``:
    the projections (``PROJECTIONS``, and ``EXPERTS`` for a mixture-of-experts model's routed
    experts) stored 4-bit, the same in every layer; the others are float. ``layout``: how
    the checkpoint packs them, GPTQ's or AWQ's."""

    group_size: int
    sym: bool
    desc_act: bool
    quantized: frozenset[str] = frozenset(PROJECTIONS)
    layout: str = GPTQ_LAYOUT


QuantScheme = W8A8Scheme | W4A16Scheme


def projection_scheme(quant: QuantScheme | None, *projections: str) -> QuantScheme | None:
    """The scheme of the layer that computes ``projections`` (one, or a fused group the config
    parser checked are stored alike)."""
    if isinstance(quant, W4A16Scheme) and projections[0] not in quant.quantized:
        return None
    if isinstance(quant, W8A8Scheme) and projections[0] in quant.float_projections:
        return None
    return quant
