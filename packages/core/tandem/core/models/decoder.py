"""The Llama-style decoder shared by Llama, Qwen2 and Qwen3: pre-norm blocks of grouped-query
attention and a gated MLP. Family differences are config switches (biases, q/k norm, ties)."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from tandem.collectives import ProcessGroup
from tandem.core.kernels import handles
from tandem.core.kernels.attention_metadata import AttentionMetadata
from tandem.core.layers.attention import PagedAttention
from tandem.core.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tandem.core.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tandem.core.layers.norm import RMSNorm
from tandem.core.layers.quant_scheme import projection_scheme
from tandem.core.layers.rotary import RotaryEmbedding
from tandem.core.models.causal_lm import CausalLM
from tandem.core.models.int4_shard_check import ShardedProjection, check_int4_shards
from tandem.core.models.model_config import ModelConfig, parse_plain_config
from tandem.core.models.weight_mapping import QKV_GATE_UP, WeightMapping


class DecoderAttention(nn.Module):
    def __init__(self, config: ModelConfig, group: ProcessGroup):
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_heads,
            config.num_kv_heads,
            bias=config.qkv_bias,
            group=group,
            quant=projection_scheme(config.quantization, "self_attn.q_proj"),
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim,
            config.hidden_size,
            bias=config.o_bias,
            group=group,
            quant=projection_scheme(config.quantization, "self_attn.o_proj"),
        )
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim**-0.5
        )
        # Qwen3's q/k norm and the rotary embedding: one fused pass over q and k on CPU.
        self._qk = handles.qk_norm_rotary()
        self._eps = config.rms_norm_eps

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        rotary: RotaryEmbedding,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``rotary``: the model's table, shared by every layer."""
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q_weight = self.q_norm.weight if self.q_norm is not None else None
        k_weight = self.k_norm.weight if self.k_norm is not None else None
        q, k = self._qk(q, k, q_weight, k_weight, self._eps, rotary.cos, rotary.sin, positions)
        out: torch.Tensor = self.o_proj(self.attn(q, k, v, meta))
        return out


class DecoderMLP(nn.Module):
    def __init__(self, config: ModelConfig, group: ProcessGroup):
        super().__init__()
        self.act = handles.gated_activation(config.hidden_act)
        # SiLU-and-mul in the gate/up kernel's epilogue where it has one (CPU: AVX2, AVX-512, AMX).
        self.fuses_silu = config.hidden_act == "silu"
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size,
            [config.intermediate_size] * 2,
            bias=config.mlp_bias,
            group=group,
            quant=projection_scheme(config.quantization, "mlp.gate_proj"),
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size,
            config.hidden_size,
            bias=config.mlp_bias,
            group=group,
            quant=projection_scheme(config.quantization, "mlp.down_proj"),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj.silu_matmul(x) if self.fuses_silu else None
        out: torch.Tensor = self.down_proj(self.act(self.gate_up_proj(x)) if h is None else h)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, group: ProcessGroup, mlp: nn.Module):
        super().__init__()
        self.self_attn = DecoderAttention(config, group)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried apart from the block outputs, so each residual add
        fuses with the norm after it: (block output, residual) in, the same out. Equal to
        ``x += attn(norm(x)); x += mlp(norm(x))``."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(positions, h, rotary, meta)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        out: torch.Tensor = self.mlp(h)
        return out, residual


class DecoderForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, group: ProcessGroup, dtype: torch.dtype):
        super().__init__(config, group, dtype)
        # A 4-bit shard that would cut a group is refused here, naming the layer, before the
        # layers' own checks would refuse it without a name.
        check_int4_shards(config.quantization, self.sharded_projections(), group.size)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group)
        # One table for every layer (a table per layer costs hundreds of MB at a real
        # max_position_embeddings).
        self.rotary = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            dtype,
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, group, self.build_mlp(i, group)) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, group)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def build_mlp(self, layer_index: int, group: ProcessGroup) -> nn.Module:
        """The feed-forward block of layer ``layer_index``; MoE families override it."""
        return DecoderMLP(self.config, group)

    def mlp_sharded_projections(self, layer_index: int) -> list[ShardedProjection]:
        """How the row-parallel projections of ``build_mlp``'s block split their inputs."""
        inputs = self.config.intermediate_size
        return [ShardedProjection(layer_index, "mlp.down_proj", split_inputs=inputs)]

    def sharded_projections(self) -> list[ShardedProjection]:
        """Each layer's row-parallel projections and their inputs; the column-parallel ones
        split by heads and by the same intermediate size, so they cut a packed word only
        where these already cut a group."""
        attention = self.config.num_heads * self.config.head_dim
        found: list[ShardedProjection] = []
        for i in range(self.config.num_layers):
            found.append(ShardedProjection(i, "self_attn.o_proj", split_inputs=attention))
            found += self.mlp_sharded_projections(i)
        return found

    def attention_layers(self) -> list[PagedAttention]:
        return [cast(DecoderLayer, layer).self_attn.attn for layer in self.layers]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, self.rotary, meta)
        if residual is None:
            out: torch.Tensor = self.norm(x)
            return out
        out, _ = self.norm.add_and_norm(x, residual)
        return out

    @staticmethod
    def parse_config(raw: dict[str, Any], arch: str) -> ModelConfig:
        return parse_plain_config(raw, arch)

    SERVES_W8A8 = True

    # How its checkpoint's names map to its parameters (weight_mapping.py).
    WEIGHTS = WeightMapping(
        fused=QKV_GATE_UP, prefixes=("model.",), ignored=("rotary_emb.inv_freq",)
    )
