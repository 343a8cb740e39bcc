"""Attention over the paged KV cache through torch_npu's fused ops, as vllm-ascend calls them:
``_npu_reshape_and_cache`` writes the step's K/V into their slots, ``_npu_paged_attention``
attends one query per sequence (decode), ``npu_fused_infer_attention_score`` the prefill
chunks (TND layout, the cache read through the block table, causal from the bottom right so
a chunk sees its sequence's cached context). The caches are the engine's own [blocks,
block_size, kv_heads, head_dim] (ND), which is what these ops read; the lengths they want on
the host come from the step's plan (``AttentionGroup.host_*``), so nothing is read back."""

from __future__ import annotations

from functools import cache

import torch
import torch_npu

from tandem.core.kernels.attention_metadata import AttentionGroup, AttentionMetadata

# sparse_mode 3 (rightDownCausal) takes the causal mask compressed to this square.
CAUSAL_MASK_SIZE = 2048
RIGHT_DOWN_CAUSAL = 3


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    torch_npu._npu_reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping_int32())


def paged_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    assert group.host_kv_lens is not None
    torch_npu._npu_paged_attention(
        q,
        k_cache,
        v_cache,
        k_cache.shape[2],
        q.shape[1],
        scale,
        group.block_table_int32(),
        group.host_kv_lens,
        out,
    )
    return out


@cache
def causal_mask(device: torch.device) -> torch.Tensor:
    """True above the diagonal: what sparse_mode 3 leaves out. One per device, made once."""
    ones = torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.bool, device=device)
    return ones.triu_(diagonal=1)


def paged_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    assert group.host_query_lens is not None and group.host_kv_lens is not None
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    flat = (num_blocks, block_size, num_kv_heads * head_dim)  # BnBsH
    attended, _ = torch_npu.npu_fused_infer_attention_score(
        q,
        k_cache.view(flat),
        v_cache.view(flat),
        atten_mask=causal_mask(q.device),
        actual_seq_lengths=group.host_query_lens.cumsum(0).tolist(),
        actual_seq_lengths_kv=group.host_kv_lens.tolist(),
        block_table=group.block_table_int32(),
        num_heads=q.shape[1],
        scale=scale,
        input_layout="TND",
        num_key_value_heads=num_kv_heads,
        sparse_mode=RIGHT_DOWN_CAUSAL,
        block_size=block_size,
    )
    out.copy_(attended)
    return out
