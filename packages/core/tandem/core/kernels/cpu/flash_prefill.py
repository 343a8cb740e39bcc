"""Long prefill chunks through torch's CPU flash attention where it multiplies on AMX tiles.

The native prefill kernel (``prefill_attention``) multiplies with vector instructions
(vdpbf16ps for bfloat16). On CPUs with AMX, torch's flash attention packs bfloat16 tiles for
the AMX units instead, and for prompts of a hundred tokens or more that is the faster of the
two; below that its per-call cost wins out. Measured on an AMX Xeon, 2 threads, one layer
of the bench model (16 query / 8 KV heads of 64), bfloat16, ms:

    tokens x prompts   native kernel   flash, a call per prompt
        16 x 32             0.39            1.54
        64 x 16             1.50            1.73
       128 x 16             4.68            3.40
       256 x 8              8.25            4.48
      2048 x 1             59.0            21.2

So a prefill chunk's fresh prompts (nothing cached before them, all their keys and values
new in this step) of at least ``FLASH_MIN_TOKENS`` go to flash attention on their own
q/k/v. Chunks of as many tokens after cached ones (the rest of a prompt that chunked
prefill split, or a prompt after a prefix-cache hit) go too, where the cached tokens are at
most ``FLASH_MAX_CACHED_RATIO`` times the chunk's own, in two calls: the chunk's
queries over the cached keys (gathered from the paged cache, no mask) and over its own
(causal), merged by their log-sum-exps, so each output is rounded to bfloat16 twice (within
two units in the last place). One layer of the bench MoE model (8 query / 2 KV heads of
64), a chunk of 832 tokens after 128 cached: 3.5-5.4 ms. Short chunks stay with the native
kernel. float32 stays native where the kernels are built with AVX-512 (8.8 vs 14.6 ms at
256 x 8), as does bfloat16 without AMX (4.2 vs 18 ms on AVX512-BF16); without AVX-512,
float32's long chunks go to flash attention too (``flash_prefill_dtypes``).

Where the AMX tile kernel loads (``amx_prefill``), it takes these chunks instead, fresh or
not, all of a step's in one call and from ``TILE_MIN_TOKENS`` up (``split_prefill``'s
``min_tokens``), K/V read from the cache, after any number of cached tokens up to
``TILE_MAX_KEYS`` in all (its packing of them costs far less than the vector kernel's slower
arithmetic: 256 new tokens after 8192 cached, 8 / 2 heads, 6.95 against 26.0 ms).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.core.kernels.cpu.native_build import selected_isa

FLASH_MIN_TOKENS = 128
# A chunk after cached tokens goes to flash attention only where those are at most this
# many times its own: its cached K/V are copied out of the paged cache for the call, where
# the native kernel reads them in place, and only a chunk of 832 after 128 cached was
# timed. A short chunk after a long cached context (a prefix-cache hit) stays native.
FLASH_MAX_CACHED_RATIO = 4

# The native kernel's share of a prefill group, rows of its per-sequence tensors: block
# table rows, first query rows, query lengths, tokens attended.
NativeShare = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def flash_prefill_dtypes() -> frozenset[torch.dtype]:
    """The dtypes whose long chunks flash attention runs faster than the native kernel on
    this CPU: bfloat16 where torch finds AMX tiles; float32 where the native kernels are built
    without AVX-512 (AVX2 and below), whose float32 kernel multiplies 8 lanes at a time. On
    a 2-core AMD EPYC (Zen 3, AVX2 only), one float32 layer, fresh prompts, ms (flash /
    native, ``benchmarks/prefill_chunk_attention.py --dtype float32``): 16 / 8 heads of 64,
    16 x 64 5.3 / 6.8, 16 x 128 16.4 / 21.5, 8 x 256 32.1 / 47.1, 1 x 2048 98 / 294; after
    256 cached tokens 8 x 256 44.5 / 107.6. Below 64 tokens the native kernel wins (48 x 8
    4.5 / 2.2). With AVX-512, float32 stays native (8.8 against 14.6 ms at 8 x 256 on Xeon)."""
    dtypes = {torch.bfloat16} if torch.cpu._is_amx_tile_supported() else set()
    if "avx512f" not in selected_isa().cpu_flags():
        dtypes.add(torch.float32)
    return frozenset(dtypes)


@dataclass(frozen=True)
class ContinuedChunk:
    """A chunk after ``cached`` tokens of its sequence, for flash attention."""

    start: int  # first query row
    tokens: int
    cached: int
    blocks: torch.Tensor  # the sequence's block-table row


@dataclass(frozen=True)
class PrefillSplit:
    """A prefill group divided between the two kernels, once per step."""

    # (first query row, tokens) of each fresh prompt flash attention takes.
    flash: tuple[tuple[int, int], ...]
    # The chunks after cached tokens flash attention takes.
    continued: tuple[ContinuedChunk, ...]
    # Every chunk flash attention takes, fresh or not, as the native kernel's share is given
    # (the AMX tile kernel's arguments); None when there is none.
    long: NativeShare | None
    # The native kernel's share; None when flash attention takes everything.
    native: NativeShare | None


def _share(rows: torch.Tensor, whole: NativeShare) -> NativeShare | None:
    """The sequences where ``rows`` (bool) is set, of the group's per-sequence tensors."""
    picked = rows.nonzero().squeeze(1)
    if picked.numel() == 0:
        return None
    if picked.numel() == rows.numel():
        return whole
    blocks, starts, query_lens, kv_lens = whole
    return blocks[picked], starts[picked], query_lens[picked], kv_lens[picked]


def split_prefill(
    blocks: torch.Tensor,
    starts: torch.Tensor,
    query_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    min_tokens: int = FLASH_MIN_TOKENS,
    max_cached_ratio: int | None = FLASH_MAX_CACHED_RATIO,
    max_keys: int | None = None,
) -> PrefillSplit:
    """Chunks of at least ``min_tokens`` to flash attention (fresh prompts, ``kv_lens ==
    query_lens``, and chunks after at most ``max_cached_ratio`` times as many cached tokens,
    any number where None), every other sequence to the native kernel; with ``max_keys``,
    only chunks of sequences of at most that many tokens."""
    long = query_lens >= min_tokens
    if max_keys is not None:
        long &= kv_lens <= max_keys
    fresh = long & (kv_lens == query_lens)
    flash = tuple(
        (int(start), int(length))
        for start, length in zip(starts[fresh].tolist(), query_lens[fresh].tolist(), strict=True)
    )
    after = long & ~fresh
    if max_cached_ratio is not None:
        after &= kv_lens - query_lens <= max_cached_ratio * query_lens
    after_rows = after.nonzero().squeeze(1).tolist()
    continued = tuple(
        ContinuedChunk(
            start=int(starts[i]),
            tokens=int(query_lens[i]),
            cached=int(kv_lens[i] - query_lens[i]),
            blocks=blocks[i],
        )
        for i in after_rows
    )
    whole = (blocks, starts, query_lens, kv_lens)
    taken = fresh | after
    return PrefillSplit(flash, continued, _share(taken, whole), _share(~taken, whole))


def flash_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spans: tuple[tuple[int, int], ...],
    scale: float,
    out: torch.Tensor,
) -> None:
    """Causal attention of each span's rows of ``q`` [N, H, D] over the same rows of ``k``
    and ``v`` [N, Hkv, D], into ``out`` [N, H, D]. Views, no copies in: flash attention
    takes the [1, H, L, D] strides of the fused projection as they are."""
    gqa = q.shape[1] != k.shape[1]
    for start, length in spans:
        rows = slice(start, start + length)
        o = F.scaled_dot_product_attention(
            _heads_first(q[rows]),
            _heads_first(k[rows]),
            _heads_first(v[rows]),
            is_causal=True,
            scale=scale,
            enable_gqa=gqa,
        )
        out[rows].copy_(o[0].transpose(0, 1))


def flash_attend_continued(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunks: tuple[ContinuedChunk, ...],
    scale: float,
    out: torch.Tensor,
) -> None:
    """Attention of each chunk's rows of ``q`` [N, H, D] over its sequence's cached tokens
    (from the caches [blocks, block_size, Hkv, D]) and, causally, its own rows of ``k`` and
    ``v``, into ``out``: two flash calls whose outputs are weighed by their log-sum-exps."""
    block_size = k_cache.shape[1]
    for chunk in chunks:
        rows = slice(chunk.start, chunk.start + chunk.tokens)
        used = chunk.blocks[: -(-chunk.cached // block_size)]
        cached_k, cached_v = (
            cache.index_select(0, used).flatten(0, 1)[: chunk.cached]
            for cache in (k_cache, v_cache)
        )
        queries = _heads_first(q[rows])
        old, old_lse = _flash(queries, _heads_first(cached_k), _heads_first(cached_v), False, scale)
        own, own_lse = _flash(queries, _heads_first(k[rows]), _heads_first(v[rows]), True, scale)
        top = torch.maximum(old_lse, own_lse)
        old_weight, own_weight = (old_lse - top).exp_(), (own_lse - top).exp_()
        merged = old.float() * old_weight.unsqueeze(-1)
        merged.add_(own.float() * own_weight.unsqueeze(-1))
        merged.div_((old_weight + own_weight).unsqueeze(-1))
        out[rows].copy_(merged[0].transpose(0, 1))


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[L, H, D] rows as flash attention's [1, H, L, D] (a view)."""
    return x.unsqueeze(0).transpose(1, 2)


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU flash attention with its log-sum-exp of each query row's scores (float32
    [1, H, L]), which the public ``scaled_dot_product_attention`` does not return."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale
    )
    return out, lse
