"""The CPU 4-bit linear (``kernels/cpu/int4_linear``) against the torch reference it replaces
and the dense float32 and bfloat16 ``F.linear`` of the same shape, on the bench model's shapes
(K = 1024 inputs; N = 1024, 2816, 3072 outputs) at decode and prefill batch sizes. The sides
run interleaved (A B A B ...), each figure the median of --rounds; GB/s counts the weight
bytes each side reads per call (codes, scales and zero points for 4-bit), each call to the
next of enough copies of the weight that they do not fit in the last-level cache, as a
model's weights do not. The CPU and the load average are printed with the figures: on a
shared host they move them.

    python benchmarks/int4_gemm.py [--rows 1 8 32 256] [--outputs 1024 2816 3072] [--rounds 5]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from compare import cpu_line

from tandem.core.kernels.cpu.int4_linear import NativeInt4Linear, load_native_int4_linear
from tandem.core.kernels.reference.int4_linear import dequantize_int4, int4_linear
from tandem.core.kernels.reference.int4_packing import pack_int4

INPUTS = 1024
GROUP = 128
# A call is repeated until it has run this long, per round and side.
_MIN_SECONDS = 0.05


def _ms(run: Callable[[], object]) -> float:
    run()
    calls, start = 0, time.perf_counter()
    while True:
        run()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= _MIN_SECONDS:
            return 1000 * elapsed / calls


def _interleaved(sides: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, run in sides.items():
            times[name].append(_ms(run))
    return {name: statistics.median(values) for name, values in times.items()}


Layer = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _cycle(calls: list[Callable[[], object]]) -> Callable[[], object]:
    """One call a time, each to the next copy of the weight."""
    turn = itertools.count()

    def run() -> object:
        return calls[next(turn) % len(calls)]()

    return run


def _sides(
    kernel: NativeInt4Linear, layers: list[Layer], x32: torch.Tensor, x16: torch.Tensor
) -> dict[str, Callable[[], object]]:
    """Each side over every copy: (codes, scales f32, scales bf16, zeros, w f32, w bf16)."""
    return {
        "int4 kernel f32": _cycle(
            [partial(kernel.int4_linear, x32, c, s, z, None, None) for c, s, _, z, _, _ in layers]
        ),
        "int4 kernel bf16": _cycle(
            [partial(kernel.int4_linear, x16, c, s, z, None, None) for c, _, s, z, _, _ in layers]
        ),
        "int4 ref bf16": _cycle(
            [partial(int4_linear, x16, c, s, z, None, None) for c, _, s, z, _, _ in layers]
        ),
        "dense f32": _cycle([partial(F.linear, x32, w) for _, _, _, _, w, _ in layers]),
        "dense bf16": _cycle([partial(F.linear, x16, w) for _, _, _, _, _, w in layers]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256])
    parser.add_argument("--outputs", type=int, nargs="+", default=[1024, 2816, 3072])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--working-set-mb", type=int, default=96, help="4-bit bytes cycled through per side"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: its default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernel = load_native_int4_linear()
    if kernel is None:
        print("no native 4-bit kernel (no compiler?): nothing to compare")
        return 1
    print(cpu_line())
    print(f"kernel path: {kernel.compiled_path}; torch threads: {torch.get_num_threads()}")
    print(f"load average at start: {os.getloadavg()}")
    gen = torch.Generator().manual_seed(0)
    print(f"{'N':>5} {'M':>4} {'side':<16} {'ms':>9} {'GB/s':>7}")
    for n in args.outputs:
        groups = INPUTS // GROUP
        codes = pack_int4(torch.randint(0, 16, (n, INPUTS), generator=gen), dim=1)
        zeros = torch.full((n, groups), 8, dtype=torch.uint8)
        scales = torch.rand(n, groups, generator=gen) * 0.01
        s16 = scales.to(torch.bfloat16)
        int4_bytes = codes.numel() * 4 + zeros.numel() + scales.numel() * 2
        # Distinct copies of every weight, called in turn, so the 4-bit side's working set
        # (and so the dense sides', larger) exceeds the last-level cache, as a model's does.
        copies = max(1, -(-args.working_set_mb * 2**20 // int4_bytes))
        w32 = dequantize_int4(codes, scales, zeros, None, torch.float32)
        layers = [
            (codes.clone(), scales.clone(), s16.clone(), zeros.clone(), w32.clone(),
             w32.to(torch.bfloat16))
            for _ in range(copies)
        ]  # fmt: skip
        weight_bytes = {
            "int4 kernel f32": int4_bytes,
            "int4 kernel bf16": int4_bytes,
            "int4 ref bf16": int4_bytes,
            "dense f32": w32.numel() * 4,
            "dense bf16": w32.numel() * 2,
        }
        for m in args.rows:
            x32 = torch.randn(m, INPUTS, generator=gen)
            x16 = x32.to(torch.bfloat16)
            sides = _sides(kernel, layers, x32, x16)
            for name, ms in _interleaved(sides, args.rounds).items():
                gbps = weight_bytes[name] / (ms / 1000) / 1e9
                print(f"{n:>5} {m:>4} {name:<16} {ms:>9.3f} {gbps:>7.1f}", flush=True)
        del layers
    print(f"load average at end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
