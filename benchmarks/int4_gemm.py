"""The CPU 4-bit linear (``kernels/cpu/int4_linear``) against the torch reference it replaces
and the dense float32 and bfloat16 ``F.linear`` of the same shape, on the bench model's
projections (``--shapes``: qkv_proj [2048, 1024], o_proj [1024, 1024], gate_up_proj
[5632, 1024], down_proj [1024, 2816]; group size 128) at decode and prefill batch sizes. The
sides run interleaved (A B A B ...), each figure the median of --rounds; GB/s counts the
weight bytes each side reads per call (codes, scales and zero points for 4-bit), each call to
the next of enough copies of the weight that they do not fit in the last-level cache, as a
model's weights do not. The CPU and the load average are printed with the figures: on a
shared host they move them.

``--baseline REV`` adds the kernel as git revision REV had it (its C++ source built beside
the current one, called through the current Python side, which gives a library without the
newer paths what it gave then): an A/B of a kernel change, interleaved with the rest.
``--sides`` keeps only the named sides.

    python benchmarks/int4_gemm.py [--rows 1 8 32 256] [--shapes qkv_proj down_proj]
        [--rounds 5] [--threads 1] [--baseline HEAD~1] [--sides "int4 kernel bf16" ...]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from compare import cpu_line

from tandem.core.kernels.cpu.int4_linear import SOURCE, NativeInt4Linear, load_native_int4_linear
from tandem.core.kernels.cpu.native_build import BASE_FLAGS, build_library
from tandem.core.kernels.reference.int4_linear import dequantize_int4, int4_linear
from tandem.core.kernels.reference.int4_packing import pack_int4

# [out_features, in_features] of the bench model (`tandem make-demo-model --preset bench`).
SHAPES = {
    "qkv_proj": (2048, 1024),
    "o_proj": (1024, 1024),
    "gate_up_proj": (5632, 1024),
    "down_proj": (1024, 2816),
}
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


def _baseline(rev: str, build_dir: Path) -> NativeInt4Linear:
    """The kernel library built from revision ``rev``'s source (and the headers beside it)."""
    root = Path(
        subprocess.run(
            ["git", "rev-parse", "--show-toplevel"],
            cwd=SOURCE.parent, capture_output=True, text=True, check=True,
        ).stdout.strip()
    )  # fmt: skip
    csrc = build_dir / "csrc"
    csrc.mkdir(parents=True, exist_ok=True)
    for name in [SOURCE.name, *(h.name for h in SOURCE.parent.glob("*.h"))]:
        path = (SOURCE.parent / name).relative_to(root)
        text = subprocess.run(
            ["git", "show", f"{rev}:{path}"], cwd=root, capture_output=True, check=True
        ).stdout
        (csrc / name).write_bytes(text)
    return NativeInt4Linear(
        build_library(csrc / SOURCE.name, "tandem_int4_baseline", BASE_FLAGS, build_dir)
    )


def _sides(
    kernel: NativeInt4Linear,
    baseline: NativeInt4Linear | None,
    layers: list[Layer],
    x32: torch.Tensor,
    x16: torch.Tensor,
) -> dict[str, Callable[[], object]]:
    """Each side over every copy: (codes, scales f32, scales bf16, zeros, w f32, w bf16)."""
    old: dict[str, Callable[[], object]] = {}
    if baseline is not None:
        old = {
            "int4 base f32": _cycle(
                [partial(baseline.int4_linear, x32, c, s, z, None, None)
                 for c, s, _, z, _, _ in layers]
            ),
            "int4 base bf16": _cycle(
                [partial(baseline.int4_linear, x16, c, s, z, None, None)
                 for c, _, s, z, _, _ in layers]
            ),
        }  # fmt: skip
    return {
        **old,
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
    parser.add_argument(
        "--shapes",
        nargs="+",
        choices=list(SHAPES),
        default=["qkv_proj", "gate_up_proj", "down_proj"],
    )
    parser.add_argument("--baseline", help="git revision whose kernel source to compare with")
    parser.add_argument("--sides", nargs="+", help="only these sides (names as printed)")
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
    baseline = None
    if args.baseline:
        baseline = _baseline(args.baseline, Path(tempfile.mkdtemp(prefix="int4-baseline-")))
    print(
        f"kernel path: {kernel.compiled_path} (bf16 dot: {kernel.bf16_dot}); "
        f"torch threads: {torch.get_num_threads()}; baseline: {args.baseline}"
    )
    print(f"load average at start: {os.getloadavg()}")
    gen = torch.Generator().manual_seed(0)
    print(f"{'N':>5} {'K':>5} {'M':>4} {'side':<16} {'ms':>9} {'GB/s':>7}")
    for shape in args.shapes:
        n, inputs = SHAPES[shape]
        groups = inputs // GROUP
        codes = pack_int4(torch.randint(0, 16, (n, inputs), generator=gen), dim=1)
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
            "int4 base f32": int4_bytes,
            "int4 base bf16": int4_bytes,
            "int4 kernel f32": int4_bytes,
            "int4 kernel bf16": int4_bytes,
            "int4 ref bf16": int4_bytes,
            "dense f32": w32.numel() * 4,
            "dense bf16": w32.numel() * 2,
        }
        for m in args.rows:
            x32 = torch.randn(m, inputs, generator=gen)
            x16 = x32.to(torch.bfloat16)
            sides = _sides(kernel, baseline, layers, x32, x16)
            if args.sides:
                sides = {name: run for name, run in sides.items() if name in args.sides}
            for name, ms in _interleaved(sides, args.rounds).items():
                gbps = weight_bytes[name] / (ms / 1000) / 1e9
                print(f"{n:>5} {inputs:>5} {m:>4} {name:<16} {ms:>9.3f} {gbps:>7.1f}", flush=True)
        del layers
    print(f"load average at end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
