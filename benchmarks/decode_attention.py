"""The native decode-attention kernel alone at a decode step's shapes: bfloat16 caches on
scattered blocks, the scores on AMX tiles against the same build's vector path, interleaved
(A B A B), ms per layer and the K/V read rate it reaches. Each pass reads every layer's
caches once, in turn, as a decode step does (so a layer's K/V are not where the previous
pass left them); a second figure repeats one layer over its first 32 tokens (its data in
cache: the kernel's arithmetic without the memory stream).

    python benchmarks/decode_attention.py [--batch 48] [--context 384 128] [--rounds 16]

A command that prints figures, not a test. Where this CPU (or TANDEM_CPU_ISA) has no AMX,
only the vector path is timed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from tandem.core.kernels.cpu.paged_attention import NativePagedAttention, native_paged_attention
from tandem.core.kv.kv_cache import allocate_kv_cache

# (query heads, KV heads, head size): the bench dense model, the bench MoE model (and the
# bench hybrid's attention layers at head size 128), a Llama-3-8B-like layer.
SHAPES = [(16, 8, 64), (8, 2, 64), (8, 2, 128), (32, 8, 128)]
BLOCK_SIZE = 16


def _timed(call: Callable[[], None], repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats * 1e3


def measure(
    kernel: NativePagedAttention,
    shape: tuple[int, int, int],
    batch: int,
    context: int,
    layers: int,
    rounds: int,
    paths: list[bool],
) -> dict[bool, tuple[float, float, float]]:
    """Per path (tiles or not): ms per layer from memory, GB/s of K/V read, ms per layer
    from cache; medians of ``rounds`` interleaved rounds."""
    heads, kv_heads, head_dim = shape
    gen = torch.Generator().manual_seed(0)
    spread = max(context // 8, 1)
    # Room in every table row for the longest length drawn below.
    width = -(-(context + spread) // BLOCK_SIZE)
    num_blocks = batch * width
    caches = allocate_kv_cache(
        layers, num_blocks - 1, BLOCK_SIZE, kv_heads, head_dim, torch.bfloat16,
        torch.device("cpu"), prefault=True,
    )  # fmt: skip
    for k_cache, v_cache in caches:
        k_cache.normal_(generator=gen)
        v_cache.normal_(generator=gen)
    tables = torch.randperm(num_blocks, generator=gen).view(batch, width).contiguous()
    rows = torch.arange(batch)
    lens = torch.randint(context - spread, context + spread - BLOCK_SIZE, (batch,), generator=gen)
    q = torch.randn(batch, heads, head_dim, generator=gen).bfloat16()
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    short_tables, short_lens = tables[:, :2].contiguous(), lens.clamp(max=2 * BLOCK_SIZE)

    def every_layer() -> None:
        for k_cache, v_cache in caches:
            kernel(out, q, k_cache, v_cache, tables, rows, lens, scale)

    def one_layer() -> None:
        kernel(out, q, caches[0][0], caches[0][1], short_tables, rows, short_lens, scale)

    cold: dict[bool, list[float]] = {path: [] for path in paths}
    hot: dict[bool, list[float]] = {path: [] for path in paths}
    try:
        for _ in range(rounds):
            for path in paths:
                kernel.use_tiles(path)
                cold[path].append(_timed(every_layer, 1) / layers)
                hot[path].append(_timed(one_layer, layers))
    finally:
        kernel.use_tiles(kernel.tiles_available)
    read_gb = int(lens.sum()) * kv_heads * head_dim * 2 * 2 / 1e9
    result = {}
    for path in paths:
        ms = statistics.median(cold[path])
        result[path] = (ms, read_gb / ms * 1e3, statistics.median(hot[path]))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument("--context", type=int, nargs="+", default=[384, 128])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=16)
    args = parser.parse_args()
    kernel = native_paged_attention()
    if kernel is None:
        print("no native decode-attention kernel here (no compiler?): nothing to time")
        return 1
    has_tiles = kernel.tiles_available
    paths = [True, False] if has_tiles else [False]
    print(
        f"decode attention, bfloat16, {torch.get_num_threads()} threads, {args.batch} queries, "
        f"blocks of {BLOCK_SIZE}, {args.layers} layers; build: {kernel.compiled_path}"
        f"{', AMX tiles' if has_tiles else ', no AMX tiles'}; medians of {args.rounds} "
        "interleaved rounds"
    )
    print(
        f"{'heads':>8} {'dim':>4} {'context':>8} {'path':>8} {'ms/layer':>9} {'K/V GB/s':>9} "
        f"{'ms from cache':>14}"
    )
    for context in args.context:
        for shape in SHAPES:
            print(f"  {shape[0]}/{shape[1]} x {shape[2]}, context {context} ...", file=sys.stderr)
            result = measure(kernel, shape, args.batch, context, args.layers, args.rounds, paths)
            for path in paths:
                ms, rate, hot = result[path]
                print(
                    f"{shape[0]:>4}/{shape[1]:<3} {shape[2]:>4} {context:>8} "
                    f"{'tiles' if path else 'vectors':>8} {ms:>9.3f} {rate:>9.1f} {hot:>14.3f}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
