"""Qwen3.5 and Qwen3.5-MoE (``*ForCausalLM``, and the text model of
``*ForConditionalGeneration``): hybrid decoders whose layers are either Gated DeltaNet linear
attention or gated full attention (``layer_types``), each followed by a dense gated MLP
(Qwen3.5) or a sparse MoE block with a shared expert (Qwen3.5-MoE). All RMSNorms but the
DeltaNet's gated one are zero-centred; rotary covers ``partial_rotary_factor`` of each head.

Driving it (the engine's side of the contract):

* ``model(input_ids, positions, meta)`` exactly as the dense decoder: tokens laid out decodes
  first, then prefill chunks; ``meta`` the step's ``AttentionMetadata``, whose ``linear`` field
  carries the ``LinearAttentionMetadata`` of the step (``build_linear_attention_metadata``).
* Full-attention layers use the paged KV cache: ``attention_layers()`` lists their
  ``PagedAttention`` modules, sized and bound as for the dense models (``bind_cache``).
* Linear-attention layers keep one state slot per running sequence:
  ``linear_attention_layers()`` lists them; ``state_bytes_per_slot(dtype)`` is what one slot
  costs on this rank across all of them (size the slot pool with the KV blocks from the same
  budget); ``allocate_linear_attention_state`` (layers/linear_attention_state.py) allocates and
  binds the pools, or bind your own with ``GatedDeltaNet.bind_state``. A slot must stay with its
  sequence from its first chunk to its end; a sequence preempted by recompute starts over with
  ``has_initial_state`` False, which needs no clearing of the slot.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any, cast

import torch
from torch import nn

from tandem.collectives import ProcessGroup
from tandem.core.kernels.attention_metadata import AttentionMetadata
from tandem.core.kernels.linear_attention_metadata import (
    LinearAttentionMetadata,
    build_linear_attention_metadata,
)
from tandem.core.layers.attention import PagedAttention
from tandem.core.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tandem.core.layers.gated_attention import GatedAttention
from tandem.core.layers.gated_delta_net import GatedDeltaNet, gates_fused
from tandem.core.layers.linear_attention_state import state_bytes_per_slot
from tandem.core.layers.partial_rotary import PartialRotaryEmbedding
from tandem.core.layers.quant_scheme import QuantScheme
from tandem.core.layers.weights import LazyTensor
from tandem.core.layers.zero_centered_rms_norm import ZeroCenteredRMSNorm
from tandem.core.models.causal_lm import CausalLM
from tandem.core.models.decoder import DecoderMLP
from tandem.core.models.int4_shard_check import check_int4_shards
from tandem.core.models.model_config import ModelConfig
from tandem.core.models.multi_token_predictor import MultiTokenPredictor
from tandem.core.models.projection_match import DecoderLayout
from tandem.core.models.qwen3_5_quantized_parts import refuse_quantized_mtp, sharded_projections
from tandem.core.models.qwen3_family_config import (
    LINEAR_ATTENTION,
    Qwen3FamilyConfig,
    family_config,
    parse_family_config,
)
from tandem.core.models.qwen3_moe import sparse_moe_block
from tandem.core.models.weight_mapping import QKV_GATE_UP, FusedShard, WeightMapping

# Where the text model's tensors live: under the language model of a composite checkpoint,
# else under ``model.`` (transformers loads both into either class).
_TEXT_PREFIXES = ("model.language_model.", "model.")
# Tensors a text-only model does not use: the vision tower, the multi-token-prediction head
# (unless speculative decoding drafts with it).
_SKIPPED_PREFIXES = ("model.visual.", "mtp.")
_SKIPPED_WITH_MTP = ("model.visual.",)
# A Gated DeltaNet's checkpoint projections into its fused ones (``gated_delta_net.py``): b
# and a apart in ``in_proj_ba``, or in ``in_proj_qkvz`` with q, k, v and z.
_QKVZ: tuple[FusedShard, ...] = (
    ("in_proj_qkv", "in_proj_qkvz", "in_proj_qkv"),
    ("in_proj_z", "in_proj_qkvz", "in_proj_z"),
)
_GATES_APART: tuple[FusedShard, ...] = (
    ("in_proj_b", "in_proj_ba", "in_proj_b"),
    ("in_proj_a", "in_proj_ba", "in_proj_a"),
)
_GATES_IN_QKVZ: tuple[FusedShard, ...] = (
    ("in_proj_b", "in_proj_qkvz", "in_proj_b"),
    ("in_proj_a", "in_proj_qkvz", "in_proj_a"),
)


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(
        self,
        config: Qwen3FamilyConfig,
        index: int,
        group: ProcessGroup,
        full_attention: bool = False,
        quant: QuantScheme | None = None,
    ):
        """Layer ``index`` of the model (``full_attention``: gated full attention whatever
        ``layer_types`` says, as the multi-token-prediction head's layer), its projections
        quantized with ``quant``."""
        super().__init__()
        self.linear_attn: GatedDeltaNet | None = None
        self.self_attn: GatedAttention | None = None
        if config.layer_types[index] == LINEAR_ATTENTION and not full_attention:
            self.linear_attn = GatedDeltaNet(
                config.hidden_size,
                num_k_heads=config.linear_num_key_heads,
                num_v_heads=config.linear_num_value_heads,
                k_head_dim=config.linear_key_head_dim,
                v_head_dim=config.linear_value_head_dim,
                conv_kernel_size=config.linear_conv_kernel_dim,
                activation=config.hidden_act,
                eps=config.rms_norm_eps,
                group=group,
                quant=quant,
            )
        else:
            self.self_attn = GatedAttention(
                config.hidden_size,
                num_heads=config.num_heads,
                num_kv_heads=config.num_kv_heads,
                head_dim=config.head_dim,
                bias=config.qkv_bias,
                eps=config.rms_norm_eps,
                group=group,
                quant=quant,
            )
        self.mlp: nn.Module = (
            sparse_moe_block(config, group, quant)
            if config.moe_layers[index]
            else DecoderMLP(replace(config, quantization=quant), group)
        )
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rotary: PartialRotaryEmbedding,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``rotary``: the model's table, shared by every layer (indexed at ``positions``)."""
        h = self.input_layernorm(x)
        if self.linear_attn is not None:
            h = self.linear_attn(h, meta)
        else:
            assert self.self_attn is not None
            h = self.self_attn(h, rotary, positions, meta)
        # x is this layer's own input (the previous layer's output or the embedding), so the
        # fused kernel may write the residual sum into it.
        h, x = self.post_attention_layernorm.add_and_norm(h, x)
        out: torch.Tensor = x + self.mlp(h)
        return out


class Qwen3_5ForCausalLM(CausalLM):
    # Quantized checkpoints: every projection quantized or float as the config says, routed
    # experts stacked (``quantized_moe.py``); routers, gates, norms, conv and the
    # multi-token-prediction head float.
    SERVES_W8A8 = True

    @staticmethod
    def parse_config(raw: dict[str, Any], arch: str) -> Qwen3FamilyConfig:
        return parse_family_config(raw, arch)

    @staticmethod
    def decoder_layout(config: ModelConfig) -> DecoderLayout:
        family = family_config(config)
        return DecoderLayout(
            family.num_layers,
            moe_layers=frozenset(i for i, sparse in enumerate(family.moe_layers) if sparse),
            num_experts=family.num_experts,
            linear_attention_layers=frozenset(
                i for i, kind in enumerate(family.layer_types) if kind == LINEAR_ATTENTION
            ),
            shared_expert=family.shared_expert_intermediate_size > 0,
        )

    def __init__(self, config: ModelConfig, group: ProcessGroup, dtype: torch.dtype):
        family = family_config(config)
        super().__init__(family, group, dtype)
        self.config: Qwen3FamilyConfig = family
        self.embed_tokens = VocabParallelEmbedding(family.vocab_size, family.hidden_size, group)
        self.rotary = PartialRotaryEmbedding(
            family.rotary_dim,
            family.max_position_embeddings,
            family.rope_theta,
            family.rope_scaling,
            dtype,
        )
        check_int4_shards(family.quantization, sharded_projections(family), group.size)
        self.layers = nn.ModuleList(
            Qwen3_5DecoderLayer(family, i, group, quant=family.quantization)
            for i in range(family.num_layers)
        )
        self.norm = ZeroCenteredRMSNorm(family.hidden_size, family.rms_norm_eps)
        self.lm_head = ParallelLMHead(family.vocab_size, family.hidden_size, group)
        if family.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.mtp: MultiTokenPredictor | None = None
        if family.serve_mtp:
            if family.mtp_layers < 1:
                raise ValueError(
                    f"{family.architecture} checkpoint has no multi-token-prediction head "
                    "(mtp_num_hidden_layers is 0 or missing in config.json)"
                )
            last = family.num_layers - 1  # the head's layer is of the model's last kind
            # Built float: quantized checkpoints keep the head float (``load_weights``
            # refuses one that does not).
            self.mtp = MultiTokenPredictor(
                family.hidden_size,
                family.rms_norm_eps,
                [
                    Qwen3_5DecoderLayer(family, last, group, full_attention=True)
                    for _ in range(family.mtp_layers)
                ],
            )

    def _decoder_layers(self) -> list[Qwen3_5DecoderLayer]:
        return [cast(Qwen3_5DecoderLayer, layer) for layer in self.layers]

    def attention_layers(self) -> list[PagedAttention]:
        """The full-attention layers' paged attention, in layer order (for the KV cache), then
        the multi-token-prediction head's when it is served (its first layer: the one that
        drafts; any further ones are loaded, not run)."""
        layers = list(self._decoder_layers())
        if self.mtp is not None:
            layers.append(cast(Qwen3_5DecoderLayer, self.mtp.layers[0]))
        return [layer.self_attn.attn for layer in layers if layer.self_attn is not None]

    def linear_attention_layers(self) -> list[GatedDeltaNet]:
        """The linear-attention layers, in layer order (for the state-slot pools)."""
        return [
            layer.linear_attn for layer in self._decoder_layers() if layer.linear_attn is not None
        ]

    def state_bytes_per_slot(self, dtype: torch.dtype) -> int:
        """Bytes one sequence's state slot takes on this rank over all linear-attention layers
        (``dtype``: the model's, which the conv state uses)."""
        return state_bytes_per_slot(self.linear_attention_layers(), dtype)

    def build_linear_attention_metadata(
        self,
        query_lens: torch.Tensor,
        context_lens: torch.Tensor,
        state_slots: torch.Tensor,
        num_decodes: int,
        device: torch.device,
    ) -> LinearAttentionMetadata:
        """The step's ``AttentionMetadata.linear`` from per-sequence host tensors (decodes
        first): new tokens, cached tokens after the step, state slot."""
        return build_linear_attention_metadata(
            query_lens,
            context_lens,
            state_slots,
            num_decodes=num_decodes,
            conv_kernel_size=self.config.linear_conv_kernel_dim,
            device=device,
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self._decoder_layers():
            x = layer(x, self.rotary, positions, meta)
        out: torch.Tensor = self.norm(x)
        return out

    def predict_ahead(
        self,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The multi-token-prediction head's final hidden states at ``positions``, from the
        tokens one place ahead and this model's ``hidden`` states there (``compute_logits``
        of them predicts the tokens two places ahead)."""
        if self.mtp is None:
            raise RuntimeError("the model was built without its multi-token-prediction head")
        out: torch.Tensor = self.mtp(
            self.embed_tokens(next_ids), hidden, self.rotary, positions, meta
        )
        return out

    def load_weights(self, weights: Iterable[tuple[str, LazyTensor]]) -> set[str]:
        """As ``CausalLM.load_weights``; with the multi-token-prediction head served, refused
        when the checkpoint stores it quantized (it is built float)."""
        if self.mtp is not None:
            weights = list(weights)
            refuse_quantized_mtp([name for name, _ in weights], self.config.architecture)
        return super().load_weights(weights)

    def weight_mapping(self) -> WeightMapping:
        """``WEIGHTS``, with the head's ``mtp.*`` tensors loaded when it is served, and b and
        a loaded into ``in_proj_qkvz`` where the layers compute them there (``gates_fused``:
        the same for every layer, which all get the model's scheme)."""
        mapping = self.WEIGHTS
        if gates_fused(self.config.quantization):
            mapping = replace(mapping, fused=(*QKV_GATE_UP, *_QKVZ, *_GATES_IN_QKVZ))
        if self.mtp is None:
            return mapping
        return replace(mapping, unused_prefixes=_SKIPPED_WITH_MTP, unused="the vision tower")

    WEIGHTS = WeightMapping(
        fused=(*QKV_GATE_UP, *_QKVZ, *_GATES_APART),
        prefixes=_TEXT_PREFIXES,
        unused_prefixes=_SKIPPED_PREFIXES,
        unused="the vision tower and multi-token prediction; serving text only",
    )
