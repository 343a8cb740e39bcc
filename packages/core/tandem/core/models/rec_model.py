"""A generative recommender: an encoder reads the user's history (items as semantic-id tuples),
a decoder with cross-attention ("xattention") emits one code per codebook level.

Tensor-parallel like the LLMs: attention heads and the MLP are split across ranks (column-
parallel in, row-parallel out, one all-reduce each); the small per-level embedding tables and
output heads are replicated, so every rank ends with the same logits and runs the same beam
search without another collective. Attention is dense (histories are short, the decoder emits
``num_codebooks`` tokens); the encoder's keys and values for cross-attention are computed once
per request and kept in paged blocks by the runner.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from tandem.collectives import ProcessGroup
from tandem.core.kernels import handles
from tandem.core.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from tandem.core.layers.norm import RMSNorm
from tandem.core.layers.weights import LazyTensor, copy_checked, read_shard
from tandem.core.models.rec_config import RecModelConfig
from tandem.core.models.weight_mapping import GATE_UP, WeightMapping, load_mapped_weights


class Replicated(nn.Module):
    """A weight every rank holds whole (embedding table or output head)."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols), requires_grad=False)

    def load_weight(self, param: nn.Parameter, loaded: LazyTensor, name: str) -> None:
        copy_checked(param.data, read_shard(loaded, 0, 0, param.shape[0]), name)


class RecAttention(nn.Module):
    def __init__(self, config: RecModelConfig, group: ProcessGroup) -> None:
        super().__init__()
        width = config.num_heads * config.head_dim
        self.head_dim = config.head_dim
        self.q_proj = ColumnParallelLinear(config.hidden_size, width, bias=False, group=group)
        self.k_proj = ColumnParallelLinear(config.hidden_size, width, bias=False, group=group)
        self.v_proj = ColumnParallelLinear(config.hidden_size, width, bias=False, group=group)
        self.o_proj = RowParallelLinear(width, config.hidden_size, bias=False, group=group)
        self.num_heads = self.q_proj.out_per_rank // config.head_dim

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """[..., L, heads * D] -> [..., L, heads, D]"""
        return x.view(*x.shape[:-1], self.num_heads, self.head_dim)

    def key_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.heads(self.k_proj(x)), self.heads(self.v_proj(x))

    def attend(
        self,
        x: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_mask: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        """x [B, Q, H]; k, v [B, S, heads, D]; key_mask [B, S] (True = attend)."""
        q = self.heads(self.q_proj(x)).transpose(1, 2)
        mask = key_mask[:, None, None, :] if key_mask is not None else None
        out = F.scaled_dot_product_attention(
            q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=causal
        )
        merged = out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)
        result: torch.Tensor = self.o_proj(merged)
        return result


class RecMLP(nn.Module):
    def __init__(self, config: RecModelConfig, group: ProcessGroup) -> None:
        super().__init__()
        self.act = handles.gated_activation("silu")
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=False, group=group
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, bias=False, group=group
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act(self.gate_up_proj(x)))
        return out


class EncoderLayer(nn.Module):
    def __init__(self, config: RecModelConfig, group: ProcessGroup) -> None:
        super().__init__()
        self.self_attn = RecAttention(config, group)
        self.mlp = RecMLP(config, group)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        k, v = self.self_attn.key_values(h)
        x = x + self.self_attn.attend(h, k, v, key_mask, causal=False)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: RecModelConfig, group: ProcessGroup) -> None:
        super().__init__()
        self.self_attn = RecAttention(config, group)
        self.cross_attn = RecAttention(config, group)
        self.mlp = RecMLP(config, group)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.cross_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cross_k: torch.Tensor,
        cross_v: torch.Tensor,
        cross_mask: torch.Tensor,
        beams: int,
    ) -> torch.Tensor:
        """x [R * beams, T, H]; cross_k/v [R, S, heads, D]; cross_mask [R, S]."""
        h = self.input_layernorm(x)
        k, v = self.self_attn.key_values(h)
        x = x + self.self_attn.attend(h, k, v, None, causal=True)
        # Every beam of a request reads the same encoder keys: fold the beams into the query
        # length instead of copying the keys per beam.
        h = self.cross_attention_layernorm(x)
        r, t = cross_k.shape[0], x.shape[1]
        folded = h.reshape(r, beams * t, h.shape[-1])
        attended = self.cross_attn.attend(folded, cross_k, cross_v, cross_mask, causal=False)
        x = x + attended.reshape(r * beams, t, -1)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class RecEncoder(nn.Module):
    def __init__(self, config: RecModelConfig, group: ProcessGroup) -> None:
        super().__init__()
        self.item_embeddings = nn.ModuleList(
            Replicated(config.codebook_size, config.hidden_size)
            for _ in range(config.num_codebooks)
        )
        self.position_embeddings = Replicated(config.max_history, config.hidden_size)
        self.layers = nn.ModuleList(
            EncoderLayer(config, group) for _ in range(config.num_encoder_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class RecDecoder(nn.Module):
    def __init__(self, config: RecModelConfig, group: ProcessGroup) -> None:
        super().__init__()
        self.bos_embedding = Replicated(1, config.hidden_size)
        self.code_embeddings = nn.ModuleList(
            Replicated(config.codebook_size, config.hidden_size)
            for _ in range(config.num_codebooks)
        )
        self.position_embeddings = Replicated(config.num_codebooks, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, group) for _ in range(config.num_decoder_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.heads = nn.ModuleList(
            Replicated(config.codebook_size, config.hidden_size)
            for _ in range(config.num_codebooks)
        )


class GenerativeRecommender(nn.Module):
    def __init__(self, config: RecModelConfig, group: ProcessGroup) -> None:
        super().__init__()
        self.config = config
        self.encoder = RecEncoder(config, group)
        self.decoder = RecDecoder(config, group)

    def cross_heads(self) -> tuple[int, int]:
        """This rank's cross-attention heads and their size (the paged cache's shape)."""
        attn = cast(DecoderLayer, self.decoder.layers[0]).cross_attn
        return attn.num_heads, attn.head_dim

    def encode(self, items: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """items [R, L, C] codes, key_mask [R, L] -> [R, L, H]"""
        enc = self.encoder
        x = enc.position_embeddings.weight[: items.shape[1]].unsqueeze(0)
        for level, table in enumerate(cast(list[Replicated], list(enc.item_embeddings))):
            x = x + F.embedding(items[..., level], table.weight)
        for layer in enc.layers:
            x = layer(x, key_mask)
        out: torch.Tensor = enc.norm(x)
        return out

    def cross_key_values(self, encoded: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per decoder layer, the cross-attention keys and values [R, L, heads, D]."""
        layers = cast(list[DecoderLayer], list(self.decoder.layers))
        return [layer.cross_attn.key_values(encoded) for layer in layers]

    def decode(
        self,
        codes: torch.Tensor,
        cross: list[tuple[torch.Tensor, torch.Tensor]],
        cross_mask: torch.Tensor,
    ) -> torch.Tensor:
        """codes [R, W, l] emitted so far -> logits [R, W, codebook_size] of level ``l``."""
        dec = self.decoder
        r, w, level = codes.shape
        x = dec.bos_embedding.weight.expand(r * w, 1, -1)
        if level:
            flat = codes.reshape(r * w, level)
            tables = cast(list[Replicated], list(dec.code_embeddings))
            emitted = [F.embedding(flat[:, j], tables[j].weight) for j in range(level)]
            x = torch.cat([x, torch.stack(emitted, dim=1)], dim=1)
        x = x + dec.position_embeddings.weight[: level + 1].unsqueeze(0)
        for layer, (k, v) in zip(dec.layers, cross, strict=True):
            x = layer(x, k, v, cross_mask, w)
        last = dec.norm(x[:, -1])
        logits = F.linear(last, cast(Replicated, dec.heads[level]).weight)
        return logits.view(r, w, -1)

    WEIGHTS = WeightMapping(fused=GATE_UP)

    def load_weights(self, weights: Iterable[tuple[str, LazyTensor]]) -> set[str]:
        return load_mapped_weights(self, weights, self.WEIGHTS, "the recommender")

    def expected_parameters(self) -> set[str]:
        return {name for name, _ in self.named_parameters()}
