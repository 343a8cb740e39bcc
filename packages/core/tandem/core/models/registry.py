"""Hugging Face architecture names the engine can serve, and the class serving each: the ones
in this package, then those other installed packages declare under the ``tandem.models``
entry point group (name = the architecture, value = ``module:Class``, a ``CausalLM``)."""

from __future__ import annotations

from importlib.metadata import entry_points

from tandem.core.errors import ModelLoadError
from tandem.core.models.causal_lm import CausalLM
from tandem.core.models.decoder import DecoderForCausalLM
from tandem.core.models.qwen3_5 import Qwen3_5ForCausalLM
from tandem.core.models.qwen3_family_config import QWEN3_5_ARCHITECTURES
from tandem.core.models.qwen3_moe import Qwen3MoeForCausalLM

ENTRY_POINT_GROUP = "tandem.models"

SUPPORTED_ARCHITECTURES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": DecoderForCausalLM,
    "Qwen2ForCausalLM": DecoderForCausalLM,
    "Qwen3ForCausalLM": DecoderForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    # The ``*ForConditionalGeneration`` ones: their text model (the vision tower is skipped).
    **{name: Qwen3_5ForCausalLM for name in QWEN3_5_ARCHITECTURES},
}


def supported_architectures() -> list[str]:
    """Every architecture name served, this package's and the installed plugins'."""
    plugins = {entry.name for entry in entry_points(group=ENTRY_POINT_GROUP)}
    return sorted(SUPPORTED_ARCHITECTURES.keys() | plugins)


def model_class(architecture: str) -> type[CausalLM]:
    """The class the engine serves ``architecture`` with."""
    cls = SUPPORTED_ARCHITECTURES.get(architecture)
    if cls is not None:
        return cls
    for entry in entry_points(group=ENTRY_POINT_GROUP, name=architecture):
        try:
            found = entry.load()
        except Exception as exc:  # a broken plugin must say which one, not crash the loader
            raise ModelLoadError(
                f"the model plugin {entry.value!r} for {architecture!r} failed to import: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if not (isinstance(found, type) and issubclass(found, CausalLM)):
            raise ModelLoadError(
                f"the model plugin {entry.value!r} for {architecture!r} is not a subclass of "
                "tandem.core.models.causal_lm.CausalLM"
            )
        return found
    raise ModelLoadError(
        f"architecture {architecture!r} is not supported; supported architectures: "
        + ", ".join(supported_architectures())
    )
