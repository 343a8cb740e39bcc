"""Qwen3-MoE: the Qwen3 decoder (q/k norm, grouped-query attention) whose MLP is a sparse
mixture of experts on every ``decoder_sparse_step``-th layer not in ``mlp_only_layers``.

It is a ``DecoderForCausalLM`` with a different feed-forward block, so the engine serves it
exactly like the dense models (paged KV cache, no per-sequence state), and the shared loader
routes its experts' tensors (``weight_mapping.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tandem.collectives import ProcessGroup
from tandem.core.layers.quant_scheme import QuantScheme
from tandem.core.layers.sparse_moe_block import SparseMoeBlock
from tandem.core.models.decoder import DecoderForCausalLM
from tandem.core.models.int4_shard_check import ShardedProjection, feed_forward_shards
from tandem.core.models.model_config import ModelConfig
from tandem.core.models.projection_match import DecoderLayout
from tandem.core.models.qwen3_family_config import (
    Qwen3FamilyConfig,
    family_config,
    parse_family_config,
)


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    # Quantized checkpoints: attention and dense MLPs as the dense decoder's, routed experts
    # stacked (``quantized_moe.py``), the router float.
    SERVES_W8A8 = True

    @staticmethod
    def parse_config(raw: dict[str, Any], arch: str) -> Qwen3FamilyConfig:
        return parse_family_config(raw, arch)

    @staticmethod
    def decoder_layout(config: ModelConfig) -> DecoderLayout:
        family = family_config(config)
        moe = frozenset(i for i, sparse in enumerate(family.moe_layers) if sparse)
        return DecoderLayout(config.num_layers, moe, family.num_experts)

    def __init__(self, config: ModelConfig, group: ProcessGroup, dtype: torch.dtype):
        family_config(config)  # fail before building anything
        super().__init__(config, group, dtype)

    def build_mlp(self, layer_index: int, group: ProcessGroup) -> nn.Module:
        config = family_config(self.config)
        if not config.moe_layers[layer_index]:
            return super().build_mlp(layer_index, group)
        return sparse_moe_block(config, group, config.quantization)

    def mlp_sharded_projections(self, layer_index: int) -> list[ShardedProjection]:
        return feed_forward_shards(family_config(self.config), layer_index)


def sparse_moe_block(
    config: Qwen3FamilyConfig, group: ProcessGroup, quant: QuantScheme | None = None
) -> SparseMoeBlock:
    return SparseMoeBlock(
        config.hidden_size,
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        normalize_topk=config.norm_topk_prob,
        shared_intermediate_size=config.shared_expert_intermediate_size,
        activation=config.hidden_act,
        group=group,
        quant=quant,
    )
