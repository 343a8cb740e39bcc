"""One layer's attention over a prefill step's chunks on CPU (bfloat16, or --dtype float32): the
AMX tile kernel (``kernels/cpu/amx_prefill.py``, every chunk in one call, K/V read from a paged
cache), torch's flash attention (a call per chunk on the projection's K/V,
``flash_prefill.flash_attend``; two and a merge after --cached tokens, gathered from the cache,
``flash_attend_continued``) and the native vector kernel (``prefill_attention``, K/V read from
the paged cache), interleaved (A B C A B C), each figure the median of --rounds. q, k and v are
views of one fused projection, as the layer leaves them. Shapes: the bench MoE model's heads
(8 query / 2 KV of 64) and the bench dense model's (16 / 8 of 64), or --heads; fresh prompts,
or chunks after --cached tokens.

    python benchmarks/prefill_chunk_attention.py [--heads 8/2 16/8] [--head-dim 64]
        [--prompts 48x8 32x16 16x32 16x64 16x128 8x256 1x2048] [--cached 0] [--rounds 5]
        [--dtype bfloat16]

Where the tile kernel does not load (no AMX) or take the dtype, its column is left out and
the difference column compares flash attention with the native kernel.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial

import torch
from linear_kernels import _interleaved_ms

from tandem.core.kernels.cpu.amx_prefill import amx_prefill
from tandem.core.kernels.cpu.flash_prefill import (
    ContinuedChunk,
    flash_attend,
    flash_attend_continued,
)
from tandem.core.kernels.cpu.prefill_attention import native_prefill_attention

BLOCK_SIZE = 16


def _pair(text: str, sep: str) -> tuple[int, int]:
    a, b = text.split(sep)
    return int(a), int(b)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", nargs="+", default=["8/2", "16/8"], help="query/KV heads")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument(
        "--prompts",
        nargs="+",
        default=["48x8", "32x16", "16x32", "16x64", "16x128", "8x256", "1x2048"],
        help="PROMPTSxTOKENS",
    )
    parser.add_argument("--cached", type=int, default=0, help="tokens before each chunk")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    tiles, native = amx_prefill(), native_prefill_attention()
    if native is None:
        print("no native prefill kernel on this CPU: nothing to compare")
        return 1
    if tiles is not None and not tiles.supports(args.head_dim, dtype):
        tiles = None
    first = "tiles" if tiles is not None else "native"
    dim = args.head_dim
    scale = dim**-0.5
    cached = args.cached
    print(f"one layer, {args.dtype}, head size {dim}, {cached} cached tokens before each chunk, "
          f"{torch.get_num_threads()} threads; ms, median of {args.rounds} interleaved rounds; "
          "GFLOP/s of the causal products (4 D (L C + L^2 / 2) a head and chunk)")  # fmt: skip
    print(f"{'heads':>6} {'prompts':>9} {'tiles':>8} {'flash':>8} {'native':>8} "
          f"{first + ' GFLOP/s':>14} {f'max |{first} - flash|':>20}")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for heads_text in args.heads:
        heads, kv_heads = _pair(heads_text, "/")
        for prompt_text in args.prompts:
            count, length = _pair(prompt_text, "x")
            rows = count * length
            qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
            q = qkv[:, : heads * dim].view(rows, heads, dim)
            k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, dim)
            v = qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim)
            starts = torch.arange(count) * length
            lens = torch.full((count,), length)
            kv_lens = lens + cached
            spans = tuple((i * length, length) for i in range(count))
            # The native and tile kernels read K/V from a paged cache: chunk i's sequence in
            # blocks of its own, its cached tokens random, then the chunk's own.
            total = cached + length
            per_seq = -(-total // BLOCK_SIZE)
            tables = (torch.arange(count * per_seq) + 1).view(count, per_seq)
            shape = (count * per_seq + 1, BLOCK_SIZE, kv_heads, dim)
            k_cache = torch.randn(shape, generator=gen).to(dtype)
            v_cache = torch.randn(shape, generator=gen).to(dtype)
            padded = per_seq * BLOCK_SIZE
            for cache, new in ((k_cache, k), (v_cache, v)):
                body = cache[1:].view(count, padded, kv_heads, dim)
                body[:, cached:total] = new.view(count, length, kv_heads, dim)
            chunks = tuple(
                ContinuedChunk(start=i * length, tokens=length, cached=cached, blocks=tables[i])
                for i in range(count)
            )
            q_rows = q.contiguous()
            outs = [torch.empty(rows, heads, dim, dtype=dtype) for _ in range(3)]
            sides: dict[str, Callable[[], object]] = {}
            if tiles is not None:
                sides["tiles"] = partial(
                    tiles, outs[0], q, k_cache, v_cache, tables, starts, lens, kv_lens, scale
                )
            sides |= {
                "flash": partial(flash_attend, q, k, v, spans, scale, outs[1])
                if cached == 0
                else partial(
                    flash_attend_continued, q, k, v, k_cache, v_cache, chunks, scale, outs[1]
                ),
                "native": partial(
                    native,
                    outs[2],
                    q_rows,
                    k_cache,
                    v_cache,
                    tables,
                    starts,
                    lens,
                    kv_lens,
                    scale,
                ),
            }
            ms = _interleaved_ms(sides, rounds=args.rounds, repeats=5)
            flops = 4 * count * heads * dim * (length * cached + length * length / 2)
            compared = outs[0] if tiles is not None else outs[2]
            diff = (compared.float() - outs[1].float()).abs().max().item()
            tile_ms = f"{ms['tiles']:8.3f}" if tiles is not None else f"{'-':>8}"
            print(f"{heads_text:>6} {prompt_text:>9} {tile_ms} {ms['flash']:8.3f} "
                  f"{ms['native']:8.3f} {flops / ms[first] / 1e6:14.0f} {diff:20.4f}",
                  flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
