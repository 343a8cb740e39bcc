"""What one linear-attention state snapshot costs (kv/state_snapshots.py): the bytes of one row
of every Gated DeltaNet layer's conv and recurrent state, and the time `copy_rows` takes to copy
it on this machine, for the bench hybrid and a Qwen3.5-4B-shaped model (one rank, TP=1). The
figures behind where snapshots are taken and the default interval (see the hybrid prefix-cache
results under benchmarks/results/).

    python benchmarks/state_snapshot_cost.py [--threads 2] [--repeats 50]
"""

from __future__ import annotations

import argparse
import time

import torch

from tandem.core.kv.kv_cache import copy_rows

# (linear-attention layers, conv channels, conv width, value heads, key dim, value dim)
SHAPES = {
    "bench (9 linear layers, 8x64x64)": (9, 1024, 4, 8, 64, 64),
    "Qwen3.5-4B-like (24 linear layers, 32x128x128)": (24, 8192, 4, 32, 128, 128),
}


def _pools(
    shape: tuple[int, int, int, int, int, int], rows: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers, channels, width, heads, key_dim, value_dim = shape
    return [
        (
            torch.zeros(rows, channels, width - 1, dtype=torch.bfloat16),
            torch.zeros(rows, heads, key_dim, value_dim, dtype=torch.float32),
        )
        for _ in range(layers)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name, shape in SHAPES.items():
        pools = _pools(shape, rows=8)
        row_bytes = sum(c[0].nbytes + r[0].nbytes for c, r in pools)
        for _ in range(3):
            copy_rows(pools, ((1, 5),))
        start = time.perf_counter()
        for _ in range(args.repeats):
            copy_rows(pools, ((1, 5),))
        seconds = (time.perf_counter() - start) / args.repeats
        print(
            f"{name}: {row_bytes / 2**20:.2f} MiB per snapshot, copy {seconds * 1e3:.3f} ms "
            f"({row_bytes / seconds / 1e9:.1f} GB/s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
