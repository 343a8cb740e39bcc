"""The native CPU attention kernels as group kernels: decodes through ``paged_attention``,
prefill chunks through ``prefill_attention`` (cached context and the chunk's own tokens in
one pass, K/V read from the cache in place), long chunks through torch's flash attention
where the CPU runs it faster (``flash_prefill``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol, TypeVar

import torch

from tandem.core.kernels.attention_metadata import AttentionGroup, GroupKernel
from tandem.core.kernels.cpu.amx_prefill import (
    TILE_MAX_KEYS,
    TILE_MIN_TOKENS,
    AmxPrefillAttention,
    amx_prefill,
)
from tandem.core.kernels.cpu.flash_prefill import (
    FLASH_MIN_TOKENS,
    NativeShare,
    flash_attend,
    flash_attend_continued,
    flash_prefill_dtypes,
    split_prefill,
)
from tandem.core.kernels.cpu.paged_attention import NativePagedAttention
from tandem.core.kernels.cpu.prefill_attention import NativePrefillAttention
from tandem.core.kernels.handle import NativeChoice

logger = logging.getLogger(__name__)


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
    kernel: NativePrefillAttention,
    flash_dtypes: frozenset[torch.dtype] | None = None,
    tiles: Callable[[], AmxPrefillAttention | None] = amx_prefill,
) -> GroupKernel:
    """Each chunk attends causally its sequence's cached tokens and its own, all read from
    the cache in place (the layer has written the chunk's K/V there); in ``flash_dtypes``
    (by default those this CPU runs faster so, see ``flash_prefill``), long chunks through
    flash attention instead: all of them in one call of the AMX tile kernel (``amx_prefill``)
    where ``tiles`` gives one, else each through torch's."""
    flash = flash_prefill_dtypes() if flash_dtypes is None else flash_dtypes
    on_tiles = tiles() if flash else None
    for dtype in flash:
        if dtype not in _said_flash:
            _said_flash.add(dtype)
            logger.info(
                "prefill attention in %s: chunks of %d tokens or more through %s, the rest "
                "through the native kernel",
                dtype,
                TILE_MIN_TOKENS if on_tiles is not None else FLASH_MIN_TOKENS,
                "the AMX tile kernel" if on_tiles is not None else "torch's flash attention",
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
            usable = on_tiles is not None and on_tiles.supports(q.shape[2], q.dtype)
            if group.split is None and usable:
                group.split = split_prefill(
                    *whole, TILE_MIN_TOKENS, max_cached_ratio=None, max_keys=TILE_MAX_KEYS
                )
            elif group.split is None:
                group.split = split_prefill(*whole)
            split = group.split
            if on_tiles is not None and usable:
                if split.long is not None:
                    on_tiles(out, _rows(q), k_cache, v_cache, *split.long, scale)
            else:
                flash_attend(q, k, v, split.flash, scale, out)
                flash_attend_continued(q, k, v, k_cache, v_cache, split.continued, scale, out)
            native = split.native
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
# dtypes whose long chunks were reported as going to flash attention: once per process,
# not once per layer.
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
