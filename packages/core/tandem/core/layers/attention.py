"""Attention over the paged KV cache.

The step's tokens are laid out decodes first (one query each), then prefill chunks. Both
groups copy their sequences' cache blocks out in order (whole blocks through the block
tables), so a chunk sees every earlier token, cached prefix included; masks hide what lies
past each sequence's end or ahead of each query. Indices and masks are built once per step
(``AttentionMetadata``) and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.core.layers.linear_attention_metadata import LinearAttentionMetadata


@dataclass
class AttentionGroup:
    """A batch of sequences whose queries are padded to one length."""

    # Cache blocks each sequence reads, in order; padding reads the null block.
    gather_blocks: torch.Tensor  # [B, N], N * block_size = L
    # True where query j of sequence b may attend context position l.
    mask: torch.Tensor | None  # [B, 1, Q, L] or None when nothing is masked
    # For prefill groups: flat token index of each padded query, and where results go back.
    query_index: torch.Tensor | None  # [B, Q]
    valid_queries: torch.Tensor | None  # [N] indices into B*Q of the real queries
    num_tokens: int


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    num_decode_tokens: int
    decode: AttentionGroup | None
    prefill: AttentionGroup | None
    # For models with linear-attention (Gated DeltaNet) layers: their per-sequence state slots.
    linear: LinearAttentionMetadata | None = None


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self._k_slots = torch.empty(0)
        self._v_slots = torch.empty(0)

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Attach this layer's caches, each [num_blocks, block_size, num_kv_heads, head_dim]."""
        self.k_cache = k_cache
        self.v_cache = v_cache
        self._k_slots = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        self._v_slots = v_cache.view(-1, self.num_kv_heads, self.head_dim)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """``q`` [T, H, D], ``k``/``v`` [T, Hkv, D] -> [T, H * D]."""
        self._k_slots.index_copy_(0, meta.slot_mapping, k)
        self._v_slots.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if meta.decode is not None:
            qd = q[:nd].unsqueeze(2)  # [B, H, 1, D]
            out[:nd] = self._attend(qd, meta.decode).squeeze(2)
        if meta.prefill is not None:
            group = meta.prefill
            assert group.query_index is not None and group.valid_queries is not None
            qp = q[nd:][group.query_index].transpose(1, 2)  # [B, H, Q, D]
            o = self._attend(qp, group).transpose(1, 2)  # [B, Q, H, D]
            out[nd:] = o.reshape(-1, self.num_heads, self.head_dim)[group.valid_queries]
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _attend(self, q: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
        b, n = group.gather_blocks.shape
        flat = group.gather_blocks.reshape(-1)
        shape = (b, n * self.k_cache.shape[1], self.num_kv_heads, self.head_dim)
        k = self.k_cache.index_select(0, flat).view(shape).transpose(1, 2)
        v = self.v_cache.index_select(0, flat).view(shape).transpose(1, 2)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=group.mask,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
