"""The routed experts of MoE layers on CPU: the per-expert torch path (oneDNN's GEMM per
active expert, the reference ``fused_moe``) against the grouped kernel this CPU packs experts
for (one call per projection for every active expert, ``kernels/cpu/grouped_moe.py``), at the
token counts given, interleaved (A B A B), each figure the median of --rounds. Each round runs
--layers layers of distinct weights one after the other, as a forward pass does, so that the
weights come from memory as they do in serving (one layer's experts alone, 31 MiB in float32
at the bench shape, would stay in a 32 MiB L3 between calls). Shapes: the bench MoE model
(`tandem make-demo-model --kind qwen3_moe --preset bench`: 8 experts of 640, hidden 512, top
2) or Qwen3-30B-A3B's (128 experts of 768, hidden 2048, top 8). Two more sides, from the
router's logits: "routed" (the native top-k, then the grouped block: a layer's calls before
``FusedMoeExperts.routed``) and "one call" (``routed``: top-k, sort, gather, both GEMMs and
the sum back in one native call, as ``SparseMoeBlock`` runs them now).

    python benchmarks/moe_experts.py [--dtype bfloat16] [--tokens 48 2048] [--shape bench]
        [--layers 12]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial

import torch
from linear_kernels import _interleaved_ms

from tandem.collectives import SingleRankGroup
from tandem.core.kernels.cpu.moe_routing import NativeMoeRouting, native_moe_routing
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
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    experts, hidden, inter, top_k = SHAPES[args.shape]
    gen = torch.Generator().manual_seed(0)
    blocks: list[FusedMoeExperts] = []
    plain: list[tuple[torch.Tensor, torch.Tensor]] = []
    for _ in range(args.layers):
        block = FusedMoeExperts(experts, hidden, inter, "silu", SingleRankGroup())
        block.w13.data = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.02).to(dtype)
        block.w2.data = (torch.randn(experts, hidden, inter, generator=gen) * 0.02).to(dtype)
        plain.append((block.w13.data.clone(), block.w2.data.clone()))
        if pack_expert_weights(block, torch.device("cpu"), dtype) == 0 or block._grouped is None:
            print(f"no grouped expert kernel serves {args.dtype} on this CPU: nothing to compare")
            return 1
        blocks.append(block)
    name = blocks[0]._grouped[0].name if blocks[0]._grouped is not None else "?"
    print(f"{args.shape} experts ({experts} x {inter}, hidden {hidden}, top {top_k}), "
          f"{args.dtype}, {torch.get_num_threads()} threads: per-expert torch path against "
          f"the grouped {name} kernel; ms per layer over {args.layers} layers, median of "
          f"{args.rounds} interleaved rounds")  # fmt: skip
    routing = native_moe_routing()
    print(f"{'tokens':>7} {'torch ms':>9} {'grouped ms':>11} {'routed ms':>10} "
          f"{'one call ms':>12} {'torch GFLOP/s':>14} {'grouped GFLOP/s':>16}")  # fmt: skip
    for tokens in args.tokens:
        print(f"  {tokens} tokens ...", file=sys.stderr, flush=True)
        x = torch.randn(tokens, hidden, generator=gen).to(dtype)
        logits = torch.randn(tokens, experts, generator=gen)
        weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
        weights = weights.to(dtype)
        sides: dict[str, Callable[[], object]] = {
            "torch": partial(
                _each, [partial(fused_moe, x, w13, w2, weights, ids, "silu") for w13, w2 in plain]
            ),
            "grouped": partial(_each, [partial(block, x, weights, ids) for block in blocks]),
        }
        if routing is not None:
            scores = logits.to(dtype)
            sides["routed"] = partial(
                _each,
                [partial(_routed_calls, routing, block, x, scores, top_k) for block in blocks],
            )
            sides["one call"] = partial(
                _each, [partial(block.routed, x, scores, top_k, True) for block in blocks]
            )
        ms = {side: t / args.layers for side, t in _interleaved_ms(sides, args.rounds, 1).items()}
        flops = 2 * tokens * top_k * 3 * hidden * inter
        rates = [flops / ms[side] / 1e6 for side in ("torch", "grouped")]
        routed, one = (f"{ms[side]:.2f}" if side in ms else "-" for side in ("routed", "one call"))
        print(f"{tokens:>7} {ms['torch']:>9.2f} {ms['grouped']:>11.2f} {routed:>10} {one:>12} "
              f"{rates[0]:>14.0f} {rates[1]:>16.0f}")  # fmt: skip
    return 0


def _routed_calls(
    routing: NativeMoeRouting,
    block: FusedMoeExperts,
    x: torch.Tensor,
    logits: torch.Tensor,
    top_k: int,
) -> None:
    block(x, *routing.topk_softmax(logits, top_k, normalize=True))


def _each(calls: list[Callable[[], object]]) -> None:
    for call in calls:
        call()


if __name__ == "__main__":
    sys.exit(main())
