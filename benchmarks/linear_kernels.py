"""Our linear kernels (``kernels/cpu/native_linear``) against oneDNN on the same packed weights:
the bench model's weight shapes, one shape at a time and all the weights of a forward pass
in sequence (dense: 8 layers x qkv/o/gate_up/down, then the LM head; hybrid: the bench
Qwen3.5's 9 Gated DeltaNet and 3 gated attention layers, each with its MLP), at the batch
sizes given. The two sides run interleaved (A B A B), each figure the median of --rounds;
oneDNN's side is what ``TANDEM_GEMM=onednn`` serves.

    python benchmarks/linear_kernels.py [--model dense|hybrid] [--dtype float32]
        [--rows 48 2048] [--rounds 6] [--streamings]

``--streamings``: the AVX-512 kernel built with each CPU vendor's weight streaming
(``avx512_linear.WeightStreaming``) beside it, the same weights, interleaved too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import torch

from tandem.core.kernels.cpu.avx2_linear import Avx2Linear
from tandem.core.kernels.cpu.avx512_linear import WeightStreaming, load_avx512_linear
from tandem.core.kernels.cpu.native_linear import AdoptedWeight, PackedWeightKernel
from tandem.core.kernels.cpu.packed_linear import native_kernel

# [out_features, in_features] of the bench models (`tandem make-demo-model --preset bench`,
# and `--kind qwen3_5`, whose Gated DeltaNet computes b and a in in_proj_qkvz: 1,552 outputs,
# packed padded to 1,600 for our kernel's panels), and the weights of one forward pass.
MODELS = {
    "dense": (
        {
            "qkv_proj": (2048, 1024),
            "o_proj": (1024, 1024),
            "gate_up_proj": (5632, 1024),
            "down_proj": (1024, 2816),
            "lm_head": (16384, 1024),
        },
        [*(["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] * 8), "lm_head"],
    ),
    "hybrid": (
        {
            "in_proj_qkvz": (1600, 768),
            "out_proj": (768, 512),
            "qkv_proj": (2560, 768),
            "o_proj": (768, 1024),
            "gate_up_proj": (5120, 768),
            "down_proj": (768, 2560),
        },
        [
            *(["in_proj_qkvz", "out_proj", "gate_up_proj", "down_proj"] * 9),
            *(["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] * 3),
        ],
    ),
}


def _onednn(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return out


def _run_onednn(
    names: list[str], x: dict[str, torch.Tensor], packed: dict[str, torch.Tensor]
) -> None:
    for name in names:
        _onednn(x[name], packed[name])


def _run_ours(
    names: list[str], x: dict[str, torch.Tensor], adopted: dict[str, AdoptedWeight]
) -> None:
    for name in names:
        adopted[name].matmul(x[name])


def _interleaved_ms(
    sides: dict[str, Callable[[], object]], rounds: int, repeats: int
) -> dict[str, float]:
    """Median ms of one call of each side, the sides alternating round by round."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, run in sides.items():
            run()
            start = time.perf_counter()
            for _ in range(repeats):
                run()
            times[name].append(1000 * (time.perf_counter() - start) / repeats)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="dense")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--rows", type=int, nargs="+", default=[48, 2048])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--streamings", action="store_true")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    shapes, forward = MODELS[args.model]
    kernel = native_kernel(dtype)
    if kernel is None:
        print(f"no native {args.dtype} linear kernel on this CPU: nothing to compare")
        return 1
    # The AVX2 kernel serves up to 128 rows; asked here at every size given (the handover
    # to oneDNN is what this measures).
    if isinstance(kernel, Avx2Linear):
        kernel = kernel.taking_rows(max(args.rows))
    kernels: dict[str, PackedWeightKernel] = {"ours": kernel}
    if args.streamings:
        for streaming in WeightStreaming:
            built = load_avx512_linear(streaming=streaming)
            chosen = None if built is None else getattr(built, args.dtype)
            if chosen is None:
                print(f"no AVX-512 {args.dtype} kernel on this CPU: no streamings to compare")
                return 1
            kernels[streaming.value] = chosen
    gen = torch.Generator().manual_seed(0)
    packed: dict[str, torch.Tensor] = {}
    adopted: dict[str, dict[str, AdoptedWeight]] = {side: {} for side in kernels}
    for name, (out_features, in_features) in shapes.items():
        weight = (torch.randn(out_features, in_features, generator=gen) * 0.02).to(dtype)
        packed[name] = torch.ops.mkldnn._reorder_linear_weight(weight, 128)
        for side, each in kernels.items():
            taken = each.adopt(packed[name], out_features, in_features)
            if taken is None:
                print(f"the {each.name} kernel did not adopt {name}: nothing to compare")
                return 1
            adopted[side][name] = taken
    print(f"{kernel.name} kernel against oneDNN, {args.dtype}, {torch.get_num_threads()} threads;")
    print(f"ms per call (per forward for 'all N'), median of {args.rounds} interleaved rounds")
    header = f"{'rows':>5} {'weights':<14} {'oneDNN ms':>10} {'ours ms':>10}"
    streamed = [side for side in kernels if side != "ours"]
    extra = "".join(f" {side + ' ms':>10}" for side in streamed)
    print(f"{header} {'oneDNN GFLOP/s':>15} {'ours GFLOP/s':>13}{extra}")
    for rows in args.rows:
        x = {name: torch.randn(rows, k, generator=gen).to(dtype) for name, (_, k) in shapes.items()}
        cases: list[tuple[str, list[str], int]] = [(name, [name], 3) for name in shapes]
        cases.append((f"all {len(forward)}", forward, 1))
        for label, names, repeats in cases:
            print(f"  {label} at {rows} rows ...", file=sys.stderr, flush=True)
            sides: dict[str, Callable[[], object]] = {
                "onednn": partial(_run_onednn, names, x, packed),
                **{side: partial(_run_ours, names, x, adopted[side]) for side in kernels},
            }
            ms = _interleaved_ms(sides, args.rounds, repeats)
            flops = sum(2 * rows * shapes[n][0] * shapes[n][1] for n in names)
            print(
                f"{rows:>5} {label:<14} {ms['onednn']:>10.2f} {ms['ours']:>10.2f} "
                f"{flops / ms['onednn'] / 1e6:>15.0f} {flops / ms['ours'] / 1e6:>13.0f}"
                + "".join(f" {ms[side]:>10.2f}" for side in streamed)
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
