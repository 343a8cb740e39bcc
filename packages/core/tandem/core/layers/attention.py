"""Attention over the paged KV cache.

The step's tokens are laid out decodes first (one query each), then prefill chunks. Each
group's attention is a kernel resolved through the kernel registry per (kernel, device,
dtype): on CPU, native kernels read K/V from the cache in place (``paged_attention_cpu``
for decodes, ``prefill_attention_cpu`` for prefill chunks, cached context and the chunk's
own tokens in one pass); elsewhere, or where they cannot be built, the torch reference
copies each sequence's cache blocks out in order (whole blocks through the block tables),
so a chunk sees every earlier token, cached prefix included, and masks hide what lies past
each sequence's end or ahead of each query. Indices and masks are built once per step
(``AttentionMetadata``) and shared by all layers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from tandem.core.layers.flash_prefill import (
    FLASH_MIN_TOKENS,
    NativeShare,
    PrefillSplit,
    flash_attend,
    flash_prefill_dtypes,
    split_prefill,
)
from tandem.core.layers.kernels import KernelHandle, NativeChoice
from tandem.core.layers.linear_attention_metadata import LinearAttentionMetadata
from tandem.core.layers.paged_attention_cpu import (
    NativePagedAttention,
    native_paged_attention,
)
from tandem.core.layers.prefill_attention_cpu import (
    NativePrefillAttention,
    native_prefill_attention,
)

logger = logging.getLogger(__name__)


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
    # For the decode kernel reading the cache in place, per query token: how many cached
    # tokens it reads and which row of gather_blocks holds its sequence's blocks.
    kv_lens: torch.Tensor | None = None  # [num_tokens] int64
    table_row: torch.Tensor | None = None  # [num_tokens] int64
    # For the prefill kernel, per sequence (row of gather_blocks): its first query row in
    # the group, its query count and the tokens it attends (cached ones and its own).
    seq_query_start: torch.Tensor | None = None  # [B] int64
    seq_query_len: torch.Tensor | None = None  # [B] int64
    seq_kv_len: torch.Tensor | None = None  # [B] int64
    # How the prefill kernel divides the group between flash attention and itself: made by
    # the first layer that needs it, the same for every layer of the step.
    split: PrefillSplit | None = None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    num_decode_tokens: int
    decode: AttentionGroup | None
    prefill: AttentionGroup | None
    # For models with linear-attention (Gated DeltaNet) layers: their per-sequence state slots.
    linear: LinearAttentionMetadata | None = None


# A group kernel: (q, k, v of the group's new tokens, k_cache, v_cache, group, scale,
# out) -> out, with q/out [N, H, D] and k/v [N, Hkv, D]; writes the attention into out.
GroupKernel = Callable[..., torch.Tensor]


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


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` [N, H, D] with contiguous [H, D] rows, as the kernel reads them (q can arrive as
    a view of a wider projection, e.g. a gated query split from its gate)."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def native_decode(kernel: NativePagedAttention) -> GroupKernel:
    def decode(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: AttentionGroup,
        scale: float,
        out: torch.Tensor,
    ) -> torch.Tensor:
        assert group.kv_lens is not None and group.table_row is not None
        rows = _rows(q)
        kernel(
            out, rows, k_cache, v_cache, group.gather_blocks, group.table_row, group.kv_lens, scale
        )
        return out

    return decode


def native_prefill(
    kernel: NativePrefillAttention, flash_dtypes: frozenset[torch.dtype] | None = None
) -> GroupKernel:
    """Each chunk attends causally its sequence's cached tokens and its own, all read from
    the cache in place (the layer has written the chunk's K/V there); in ``flash_dtypes``
    (by default those this CPU runs faster so, see ``flash_prefill``), long fresh prompts
    through torch's flash attention instead."""
    flash = flash_prefill_dtypes() if flash_dtypes is None else flash_dtypes
    for dtype in flash:
        if dtype not in _said_flash:
            _said_flash.add(dtype)
            logger.info(
                "prefill attention in %s: fresh prompts of %d tokens or more through torch's "
                "flash attention (AMX tiles here), the rest through the native kernel",
                dtype,
                FLASH_MIN_TOKENS,
            )

    def prefill(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: AttentionGroup,
        scale: float,
        out: torch.Tensor,
    ) -> torch.Tensor:
        assert group.seq_query_start is not None and group.seq_query_len is not None
        assert group.seq_kv_len is not None
        whole: NativeShare = (
            group.gather_blocks,
            group.seq_query_start,
            group.seq_query_len,
            group.seq_kv_len,
        )
        native: NativeShare | None = whole
        if q.dtype in flash:
            if group.split is None:
                group.split = split_prefill(*whole)
            flash_attend(q, k, v, group.split.flash, scale, out)
            native = group.split.native
        if native is not None:
            blocks, starts, query_lens, kv_lens = native
            kernel(out, _rows(q), k_cache, v_cache, blocks, starts, query_lens, kv_lens, scale)
        return out

    return prefill


class NativeKernel(Protocol):
    def supports(self, head_dim: int, dtype: torch.dtype) -> bool: ...


K = TypeVar("K", bound=NativeKernel)

# (kernel, head_dim, dtype) combinations already reported as falling back: once per process,
# not once per layer.
_said: set[tuple[str, int, torch.dtype]] = set()
# dtypes whose long fresh prompts were reported as going to flash attention: once per
# process, not once per layer.
_said_flash: set[torch.dtype] = set()


def native_group_kernel(
    name: str, load: Callable[[], K | None], native: Callable[[K], GroupKernel], head_dim: int
) -> NativeChoice[torch.Tensor]:
    """The native CPU attention kernel ``load`` gives, for a dtype, where it is built and
    handles the head size; a fallback is said once per process."""

    def choose(dtype: torch.dtype) -> GroupKernel | None:
        kernel = load()
        if kernel is not None and kernel.supports(head_dim, dtype):
            return native(kernel)
        if kernel is not None and (name, head_dim, dtype) not in _said:
            _said.add((name, head_dim, dtype))
            logger.info(
                "%s: the native CPU kernel does not handle head_dim %d in %s; using the "
                "torch reference",
                name,
                head_dim,
                dtype,
            )
        return None

    return choose


def group_kernel_handle(
    name: str,
    reference: GroupKernel,
    load: Callable[[], K | None],
    native: Callable[[K], GroupKernel],
    head_dim: int,
) -> KernelHandle[torch.Tensor]:
    """One attention layer's handle on a group kernel, resolved through the kernel registry
    on first use per (kernel, device, dtype, head size) like the models' other kernels."""
    return KernelHandle(
        name, reference, native_group_kernel(name, load, native, head_dim), f"head_dim={head_dim}"
    )


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
        self._decode = group_kernel_handle(
            "paged_attention_decode",
            reference_decode,
            native_paged_attention,
            native_decode,
            head_dim,
        )
        self._prefill = group_kernel_handle(
            "paged_attention_prefill",
            reference_prefill,
            native_prefill_attention,
            native_prefill,
            head_dim,
        )

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
        # Contiguous whatever q's layout: the kernels write [H, D] rows in place.
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decode_tokens
        caches = (self.k_cache, self.v_cache)
        if meta.decode is not None:
            self._decode(q[:nd], k[:nd], v[:nd], *caches, meta.decode, self.scale, out[:nd])
        if meta.prefill is not None:
            self._prefill(q[nd:], k[nd:], v[nd:], *caches, meta.prefill, self.scale, out[nd:])
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
