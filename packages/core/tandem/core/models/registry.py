"""Hugging Face architecture names the engine can serve, and the class serving each."""

from __future__ import annotations

from tandem.core.errors import ModelLoadError
from tandem.core.models.decoder import DecoderForCausalLM

SUPPORTED_ARCHITECTURES: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": DecoderForCausalLM,
    "Qwen2ForCausalLM": DecoderForCausalLM,
    "Qwen3ForCausalLM": DecoderForCausalLM,
}


def model_class(architecture: str) -> type[DecoderForCausalLM]:
    cls = SUPPORTED_ARCHITECTURES.get(architecture)
    if cls is None:
        raise ModelLoadError(
            f"architecture {architecture!r} is not supported; supported architectures: "
            + ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        )
    return cls
