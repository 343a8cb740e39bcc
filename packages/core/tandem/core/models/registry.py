"""Hugging Face architecture names the engine can serve, and the class serving each."""

from __future__ import annotations

from tandem.core.errors import ModelLoadError
from tandem.core.models.decoder import DecoderForCausalLM
from tandem.core.models.qwen3_5 import Qwen3_5ForCausalLM
from tandem.core.models.qwen3_family_config import QWEN3_5_ARCHITECTURES
from tandem.core.models.qwen3_moe import Qwen3MoeForCausalLM

# Dense and MoE decoders (paged KV cache only), and hybrid ones whose linear-attention layers
# also keep a per-sequence state slot (``linear_attention_layers()`` is empty for the others).
CausalLM = DecoderForCausalLM | Qwen3_5ForCausalLM

SUPPORTED_ARCHITECTURES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": DecoderForCausalLM,
    "Qwen2ForCausalLM": DecoderForCausalLM,
    "Qwen3ForCausalLM": DecoderForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    # The ``*ForConditionalGeneration`` ones: their text model (the vision tower is skipped).
    **{name: Qwen3_5ForCausalLM for name in QWEN3_5_ARCHITECTURES},
}


def model_class(architecture: str) -> type[CausalLM]:
    """The class the engine serves ``architecture`` with."""
    cls = SUPPORTED_ARCHITECTURES.get(architecture)
    if cls is None:
        raise ModelLoadError(
            f"architecture {architecture!r} is not supported; supported architectures: "
            + ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        )
    return cls
