"""Fresh prompts through torch's CPU flash attention where it multiplies on AMX tiles.

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
q/k/v; the rest (short prompts, chunks after cached tokens, which flash attention cannot
read from the paged cache) stay with the native kernel. float32 stays native everywhere
(8.8 vs 14.6 ms at 256 x 8), as does bfloat16 without AMX (4.2 vs 18 ms on AVX512-BF16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FLASH_MIN_TOKENS = 128

# The native kernel's share of a prefill group, rows of its per-sequence tensors: block
# table rows, first query rows, query lengths, tokens attended.
NativeShare = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def flash_prefill_dtypes() -> frozenset[torch.dtype]:
    """The dtypes whose long fresh prompts flash attention runs faster than the native
    kernel on this CPU: bfloat16 where torch finds AMX tiles, none elsewhere."""
    if torch.cpu._is_amx_tile_supported():
        return frozenset({torch.bfloat16})
    return frozenset()


@dataclass(frozen=True)
class PrefillSplit:
    """A prefill group divided between the two kernels, once per step."""

    # (first query row, tokens) of each prompt flash attention takes.
    flash: tuple[tuple[int, int], ...]
    # The native kernel's share; None when flash attention takes everything.
    native: NativeShare | None


def split_prefill(
    blocks: torch.Tensor,
    starts: torch.Tensor,
    query_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    min_tokens: int = FLASH_MIN_TOKENS,
) -> PrefillSplit:
    """Fresh prompts (``kv_lens == query_lens``) of at least ``min_tokens`` to flash
    attention, every other sequence to the native kernel."""
    to_flash = (kv_lens == query_lens) & (query_lens >= min_tokens)
    flash = tuple(
        (int(start), int(length))
        for start, length in zip(
            starts[to_flash].tolist(), query_lens[to_flash].tolist(), strict=True
        )
    )
    if not flash:
        return PrefillSplit(flash=(), native=(blocks, starts, query_lens, kv_lens))
    keep = (~to_flash).nonzero().squeeze(1)
    if keep.numel() == 0:
        return PrefillSplit(flash=flash, native=None)
    return PrefillSplit(
        flash=flash, native=(blocks[keep], starts[keep], query_lens[keep], kv_lens[keep])
    )


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
            q[rows].unsqueeze(0).transpose(1, 2),
            k[rows].unsqueeze(0).transpose(1, 2),
            v[rows].unsqueeze(0).transpose(1, 2),
            is_causal=True,
            scale=scale,
            enable_gqa=gqa,
        )
        out[rows].copy_(o[0].transpose(0, 1))
