"""Hugging Face architecture names the engine can serve, and the class serving each."""

from __future__ import annotations

from tandem.core.errors import ModelLoadError
from tandem.core.models.decoder import DecoderForCausalLM
from tandem.core.models.qwen3_5 import Qwen3_5ForCausalLM
from tandem.core.models.qwen3_family_config import QWEN3_5_ARCHITECTURES
from tandem.core.models.qwen3_moe import Qwen3MoeForCausalLM

CausalLM = DecoderForCausalLM | Qwen3_5ForCausalLM

SUPPORTED_ARCHITECTURES: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": DecoderForCausalLM,
    "Qwen2ForCausalLM": DecoderForCausalLM,
    "Qwen3ForCausalLM": DecoderForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}

# Hybrid models (linear-attention layers): the models load and run, driven with state slots
# (see models/qwen3_5.py), but the engine does not allocate state slots yet.
HYBRID_ARCHITECTURES: dict[str, type[Qwen3_5ForCausalLM]] = {
    name: Qwen3_5ForCausalLM for name in QWEN3_5_ARCHITECTURES
}


def model_class(architecture: str) -> type[DecoderForCausalLM]:
    """The class the engine serves ``architecture`` with."""
    if architecture in HYBRID_ARCHITECTURES:
        raise ModelLoadError(
            f"architecture {architecture!r} has linear-attention layers, whose per-sequence "
            "state cache the engine does not allocate yet; it cannot be served"
        )
    cls = SUPPORTED_ARCHITECTURES.get(architecture)
    if cls is None:
        raise ModelLoadError(
            f"architecture {architecture!r} is not supported; supported architectures: "
            + ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        )
    return cls


def causal_lm_class(architecture: str) -> type[CausalLM]:
    """The class of any architecture the models package implements, hybrid ones included."""
    hybrid = HYBRID_ARCHITECTURES.get(architecture)
    return hybrid if hybrid is not None else model_class(architecture)
