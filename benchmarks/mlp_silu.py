"""A dense MLP's gate/up projection and its SiLU-and-mul on CPU: the packed product then the
elementwise kernel (two calls, the [rows, 2 I] product written out and read back) against
the product with the activation in its epilogue (``PackableLinear.silu_matmul``: one call,
AVX-512 or AVX2), at the row counts given, interleaved (A B A B), each figure the median of
--rounds. Each round runs --layers layers of distinct weights one after the other, as a
forward pass does, so the weights come from memory as they do in serving. Shapes: the bench
dense model's (hidden 1024, intermediate 2816) or the bench hybrid's (768, 2560).

    python benchmarks/mlp_silu.py [--dtype bfloat16] [--rows 48 2048] [--shape dense]
        [--layers 8]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial

import torch
from linear_kernels import _interleaved_ms

from tandem.collectives import SingleRankGroup
from tandem.core.kernels import handles
from tandem.core.kernels.cpu.packed_linear import pack_linear_weights
from tandem.core.layers.linear import MergedColumnParallelLinear

# (hidden, intermediate)
SHAPES = {"dense": (1024, 2816), "hybrid": (768, 2560)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--rows", type=int, nargs="+", default=[48, 2048])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="dense")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    hidden, inter = SHAPES[args.shape]
    gen = torch.Generator().manual_seed(0)
    layers: list[MergedColumnParallelLinear] = []
    for _ in range(args.layers):
        layer = MergedColumnParallelLinear(hidden, [inter, inter], bias=False,
                                           group=SingleRankGroup())  # fmt: skip
        layer.weight.data = (torch.randn(2 * inter, hidden, generator=gen) * 0.02).to(dtype)
        pack_linear_weights(layer, torch.device("cpu"), dtype)
        layers.append(layer)
    probe = torch.randn(4, hidden).to(dtype)
    if layers[0].native is None or layers[0].silu_matmul(probe) is None:
        print(f"no fused SiLU kernel serves {args.dtype} at this shape on this CPU")
        return 1
    act = handles.gated_activation("silu")
    print(f"{args.shape} gate/up ({hidden} -> 2 x {inter}), {args.dtype}, "
          f"{torch.get_num_threads()} threads: product then SiLU-and-mul against the fused "
          f"epilogue; ms per layer over {args.layers} layers, median of {args.rounds} "
          "interleaved rounds")  # fmt: skip
    print(f"{'rows':>6} {'unfused ms':>11} {'fused ms':>9}")
    for rows in args.rows:
        print(f"  {rows} rows ...", file=sys.stderr, flush=True)
        x = torch.randn(rows, hidden, generator=gen).to(dtype)
        sides: dict[str, Callable[[], object]] = {
            "unfused": partial(_each, [partial(_unfused, act, m, x) for m in layers]),
            "fused": partial(_each, [partial(m.silu_matmul, x) for m in layers]),
        }
        ms = {side: t / args.layers for side, t in _interleaved_ms(sides, args.rounds, 1).items()}
        print(f"{rows:>6} {ms['unfused']:>11.3f} {ms['fused']:>9.3f}")
    return 0


def _unfused(
    act: Callable[[torch.Tensor], torch.Tensor], layer: MergedColumnParallelLinear, x: torch.Tensor
) -> torch.Tensor:
    return act(layer(x))


def _each(calls: list[Callable[[], object]]) -> None:
    for call in calls:
        call()


if __name__ == "__main__":
    sys.exit(main())
