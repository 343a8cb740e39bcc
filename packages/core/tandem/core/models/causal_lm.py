"""What the engine asks of a model it serves, as the base class every architecture extends.

An architecture is one module: a subclass declaring its config parser (``parse_config``), its
checkpoint mapping (``WEIGHTS``) and its layers (``__init__`` / ``forward``); then one line in
``registry.py`` or, from another package, one ``tandem.models`` entry point. The engine (the
model runner, the KV-cache and state-slot sizing) and the loader only use what is declared
here, so nothing else names the architecture.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from tandem.collectives import ProcessGroup
from tandem.core.kernels.attention_metadata import AttentionMetadata
from tandem.core.layers.attention import PagedAttention
from tandem.core.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tandem.core.layers.gated_delta_net import GatedDeltaNet
from tandem.core.layers.weights import LazyTensor
from tandem.core.models.model_config import ModelConfig
from tandem.core.models.projection_match import DecoderLayout
from tandem.core.models.weight_mapping import WeightMapping, load_mapped_weights


class CausalLM(nn.Module):
    # How the checkpoint's tensor names reach the parameters (``weight_mapping.py``).
    WEIGHTS: ClassVar[WeightMapping]
    # Whether its linear layers are built int8 for a W8A8 checkpoint (``quantization_config``);
    # a quantized checkpoint of an architecture without is refused at start-up.
    SERVES_W8A8: ClassVar[bool] = False
    # The loader ties and zero-pads these (vocab-parallel shards keep their padding rows zero).
    embed_tokens: VocabParallelEmbedding
    lm_head: ParallelLMHead

    def __init__(self, config: ModelConfig, group: ProcessGroup, dtype: torch.dtype) -> None:
        # Built on the meta device (``loader.materialize``): allocate nothing here.
        super().__init__()
        self.config = config

    @staticmethod
    def parse_config(raw: dict[str, Any], arch: str) -> ModelConfig:
        """Its config from the parsed ``config.json`` (``config_json.py`` asks the class)."""
        raise NotImplementedError

    @staticmethod
    def decoder_layout(config: ModelConfig) -> DecoderLayout:
        """Which quantizable modules its layers have, as a quantization config names them;
        dense decoder layers unless the class says otherwise (mixture-of-experts)."""
        return DecoderLayout(config.num_layers)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The final hidden states of the step's tokens."""
        raise NotImplementedError

    def attention_layers(self) -> list[PagedAttention]:
        """The layers that keep a paged KV cache, in layer order (the cache is sized for them)."""
        raise NotImplementedError

    def linear_attention_layers(self) -> list[GatedDeltaNet]:
        """The layers that keep a per-sequence state slot; none for a plain decoder. A model
        with some declares it in its config too (``has_linear_attention``: the engine keeps
        the slots' pool and turns prefix caching off from it; start-up checks both agree)."""
        return []

    def predict_ahead(
        self,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """A multi-token-prediction head's hidden states (models built with ``serve_mtp``):
        at each of ``positions``, from the token one place ahead (``next_ids``) and this
        model's final ``hidden`` state there; their logits predict the token after."""
        raise NotImplementedError(f"{self.config.architecture} has no multi-token prediction")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def weight_mapping(self) -> WeightMapping:
        """How this instance's checkpoint names map: ``WEIGHTS`` (a model whose parts depend on
        its config, such as an optional head, adjusts it here)."""
        return self.WEIGHTS

    def load_weights(self, weights: Iterable[tuple[str, LazyTensor]]) -> set[str]:
        """Load checkpoint tensors by their Hugging Face names through ``weight_mapping()``;
        returns the parameters loaded."""
        return load_mapped_weights(
            self,
            weights,
            self.weight_mapping(),
            self.config.architecture,
            self.config.tie_word_embeddings,
        )

    def expected_parameters(self) -> set[str]:
        return {name for name, _ in self.named_parameters(remove_duplicate=False)}
