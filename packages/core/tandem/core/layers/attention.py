"""Attention over the paged KV cache: the layer writes the step's new K/V into its cache
slots, then runs the decode group and the prefill group through their registry-resolved
kernels (``kernels/handles.py``), which read the cache through the block tables."""

from __future__ import annotations

import torch
from torch import nn

from tandem.core.kernels import handles
from tandem.core.kernels.attention_metadata import AttentionMetadata


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self._write = handles.write_kv_cache()
        self._decode = handles.paged_attention_decode(head_dim)
        self._prefill = handles.paged_attention_prefill(head_dim)

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Attach this layer's caches, each [num_blocks, block_size, num_kv_heads, head_dim]."""
        self.k_cache = k_cache
        self.v_cache = v_cache

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """``q`` [T, H, D], ``k``/``v`` [T, Hkv, D] -> [T, H * D]."""
        self._write(k, v, self.k_cache, self.v_cache, meta)
        # Contiguous whatever q's layout: the kernels write [H, D] rows in place.
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decode_tokens
        caches = (self.k_cache, self.v_cache)
        if meta.decode is not None:
            self._decode(q[:nd], k[:nd], v[:nd], *caches, meta.decode, self.scale, out[:nd])
        if meta.prefill is not None:
            self._prefill(q[nd:], k[nd:], v[nd:], *caches, meta.prefill, self.scale, out[nd:])
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
