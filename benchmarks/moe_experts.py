"""The routed experts of one MoE layer on CPU: the per-expert torch path (oneDNN's GEMM per
active expert, the reference ``fused_moe``) against the grouped kernel this CPU packs experts
for (one call per projection for every active expert, ``kernels/cpu/grouped_moe.py``), at the
token counts given, interleaved (A B A B), each figure the median of --rounds. Shapes: the
bench MoE model (`tandem make-demo-model --kind qwen3_moe --preset bench`: 8 experts of 640,
hidden 512, top 2) or Qwen3-30B-A3B's (128 experts of 768, hidden 2048, top 8).

    python benchmarks/moe_experts.py [--dtype bfloat16] [--tokens 48 2048] [--shape bench]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial

import torch
from linear_kernels import _interleaved_ms

from tandem.collectives import SingleRankGroup
from tandem.core.kernels.reference.fused_moe import fused_moe
from tandem.core.layers.fused_moe import FusedMoeExperts, pack_expert_weights

# (experts, hidden, moe intermediate, top k)
SHAPES = {"bench": (8, 512, 640, 2), "qwen3-30b-a3b": (128, 2048, 768, 8)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--tokens", type=int, nargs="+", default=[48, 2048])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    experts, hidden, inter, top_k = SHAPES[args.shape]
    gen = torch.Generator().manual_seed(0)
    block = FusedMoeExperts(experts, hidden, inter, "silu", SingleRankGroup())
    block.w13.data = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.02).to(dtype)
    block.w2.data = (torch.randn(experts, hidden, inter, generator=gen) * 0.02).to(dtype)
    w13, w2 = block.w13.data.clone(), block.w2.data.clone()
    if pack_expert_weights(block, torch.device("cpu"), dtype) == 0 or block._grouped is None:
        print(f"no grouped expert kernel serves {args.dtype} on this CPU: nothing to compare")
        return 1
    name = block._grouped[0].name
    print(f"{args.shape} experts ({experts} x {inter}, hidden {hidden}, top {top_k}), "
          f"{args.dtype}, {torch.get_num_threads()} threads: per-expert torch path against "
          f"the grouped {name} kernel; ms per layer, median of {args.rounds} interleaved "
          "rounds")  # fmt: skip
    print(f"{'tokens':>7} {'torch ms':>9} {'grouped ms':>11} {'torch GFLOP/s':>14} "
          f"{'grouped GFLOP/s':>16}")  # fmt: skip
    for tokens in args.tokens:
        print(f"  {tokens} tokens ...", file=sys.stderr, flush=True)
        x = torch.randn(tokens, hidden, generator=gen).to(dtype)
        logits = torch.randn(tokens, experts, generator=gen)
        weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
        weights = weights.to(dtype)
        sides: dict[str, Callable[[], object]] = {
            "torch": partial(fused_moe, x, w13, w2, weights, ids, "silu"),
            "grouped": partial(block, x, weights, ids),
        }
        ms = _interleaved_ms(sides, args.rounds, repeats=3)
        flops = 2 * tokens * top_k * 3 * hidden * inter
        rates = [flops / ms[side] / 1e6 for side in ("torch", "grouped")]
        print(f"{tokens:>7} {ms['torch']:>9.2f} {ms['grouped']:>11.2f} "
              f"{rates[0]:>14.0f} {rates[1]:>16.0f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
