"""The int8 (W8A8) routed experts of one MoE layer on CPU: each active expert's rows through
the native int8 kernel in turn (the per-expert steps, one call per expert and projection)
against the grouped kernel (one call per projection for every expert,
``NativeInt8.grouped_linear``), both over the same weights packed at load, at the token
counts given, interleaved (A B A B), each figure the median of --rounds. Per-token dynamic
activation scales, as llm-compressor's W8A8 writes them. Shapes: the bench MoE model
(`tandem make-demo-model --kind qwen3_moe --preset bench`: 8 experts of 640, hidden 512,
top 2) or Qwen3-30B-A3B's (128 experts of 768, hidden 2048, top 8).

    python benchmarks/quantized_moe_experts.py [--dtype bfloat16] [--tokens 1 48 2048]
        [--shape bench]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial

import torch
from linear_kernels import _interleaved_ms
from moe_experts import SHAPES

from tandem.collectives import SingleRankGroup
from tandem.core.kernels.cpu.int8_gemm import native_int8
from tandem.core.kernels.reference.fused_moe import topk_softmax
from tandem.core.layers.quant_scheme import W8A8Scheme
from tandem.core.layers.quantized_moe import QuantizedMoeExperts


def _experts(experts: int, hidden: int, inter: int, gen: torch.Generator) -> QuantizedMoeExperts:
    """Random int8 experts with per-channel scales, as a checkpoint's would load."""
    block = QuantizedMoeExperts(
        experts, hidden, inter, "silu", SingleRankGroup(), W8A8Scheme(static=False)
    )
    for projection, rows, columns in ((block.w13, 2 * inter, hidden), (block.w2, hidden, inter)):
        shape = (experts, rows, columns)
        projection.weight.data = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
        projection.weight_scale.data = torch.rand(experts, rows, 1, generator=gen) * 1e-3 + 1e-4
    return block


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 48, 2048])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    kernels = native_int8()
    if kernels is None:
        print("no native int8 kernel on this CPU (no compiler, or TANDEM_INT8=torch)")
        return 1
    dtype = getattr(torch, args.dtype)
    experts, hidden, inter, top_k = SHAPES[args.shape]
    gen = torch.Generator().manual_seed(0)
    grouped = _experts(experts, hidden, inter, gen)
    per_expert = _experts(experts, hidden, inter, torch.Generator().manual_seed(0))
    grouped.pack_int8(kernels)
    per_expert.pack_int8(kernels)
    # The same packed weights, through the per-expert steps (what ran before the grouped
    # kernel): the packing set the grouped kernel; unset, forward takes the spans.
    per_expert._int8 = None
    print(f"{args.shape} int8 experts ({experts} x {inter}, hidden {hidden}, top {top_k}), "
          f"{args.dtype} activations, {torch.get_num_threads()} threads, {kernels.name}: "
          f"per-expert calls against one grouped call per projection; ms per layer, median "
          f"of {args.rounds} interleaved rounds")  # fmt: skip
    print(f"{'tokens':>7} {'per-expert ms':>14} {'grouped ms':>11} {'speed-up':>9} "
          f"{'grouped GOP/s':>14}")  # fmt: skip
    for tokens in args.tokens:
        print(f"  {tokens} tokens ...", file=sys.stderr, flush=True)
        x = torch.randn(tokens, hidden, generator=gen).to(dtype)
        weights, ids = topk_softmax(torch.randn(tokens, experts, generator=gen), top_k, True)
        if not torch.equal(grouped(x, weights, ids), per_expert(x, weights, ids)):
            print(f"the two paths differ at {tokens} tokens: not measured")
            return 1
        sides: dict[str, Callable[[], object]] = {
            "per-expert": partial(per_expert, x, weights, ids),
            "grouped": partial(grouped, x, weights, ids),
        }
        ms = _interleaved_ms(sides, args.rounds, repeats=3)
        ops = 2 * tokens * top_k * 3 * hidden * inter
        print(f"{tokens:>7} {ms['per-expert']:>14.3f} {ms['grouped']:>11.3f} "
              f"{ms['per-expert'] / ms['grouped']:>8.2f}x "
              f"{ops / ms['grouped'] / 1e6:>14.0f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
