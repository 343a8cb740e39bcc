"""The torch reference of paged attention: each sequence's cache blocks copied out in order
(whole blocks through the block tables), so a chunk sees every earlier token, cached prefix
included, and masks hide what lies past each sequence's end or ahead of each query."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.core.kernels.attention_metadata import AttentionGroup, AttentionMetadata


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """The step's new ``k``/``v`` [T, Hkv, D] into their slots (block * block_size + offset)."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, meta.slot_mapping, v)


def reference_attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
) -> torch.Tensor:
    """``q`` [B, H, Q, D] over each sequence's gathered cache blocks -> [B, H, Q, D]."""
    b, n = group.gather_blocks.shape
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    flat = group.gather_blocks.reshape(-1)
    shape = (b, n * block_size, num_kv_heads, head_dim)
    k = k_cache.index_select(0, flat).view(shape).transpose(1, 2)
    v = v_cache.index_select(0, flat).view(shape).transpose(1, 2)
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=group.mask,
        scale=scale,
        enable_gqa=q.shape[1] != num_kv_heads,
    )


def reference_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    out.copy_(reference_attend(q.unsqueeze(2), k_cache, v_cache, group, scale).squeeze(2))
    return out


def reference_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    assert group.query_index is not None and group.valid_queries is not None
    num_heads, head_dim = q.shape[1], q.shape[2]
    qp = q[group.query_index].transpose(1, 2)  # [B, H, Q, D]
    o = reference_attend(qp, k_cache, v_cache, group, scale).transpose(1, 2)  # [B, Q, H, D]
    out.copy_(o.reshape(-1, num_heads, head_dim)[group.valid_queries])
    return out
