"""One bench-size Gated DeltaNet layer (``tandem make-demo-model --kind qwen3_5 --preset
bench``: hidden 768, 4 key heads and 8 value heads of 64) with b and a computed by
``in_proj_qkvz`` (fused: one packed matmul of 1,552 outputs, padded to 1,600 for our kernel)
against apart (``in_proj_ba``'s 16 outputs a second matmul, by oneDNN, off our kernel's
panels): the input projections alone, and the layer's whole forward, at decode (48 sequences
of one token) and prefill (one sequence of 2,048) sizes. Both layers hold the same random
weights, packed as the engine packs them; --threads threads (2), the sides interleaved
(A B A B), median of --rounds rounds of --calls calls each:

    python benchmarks/gdn_input_projection.py [--dtype bfloat16 float32] [--rounds 9]
        [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import timeit
from collections.abc import Callable
from functools import partial

import torch

from tandem.collectives import SingleRankGroup
from tandem.core.kernels.attention_metadata import AttentionMetadata
from tandem.core.kernels.cpu.packed_linear import pack_linear_weights
from tandem.core.kernels.linear_attention_metadata import build_linear_attention_metadata
from tandem.core.layers.gated_delta_net import GatedDeltaNet

HIDDEN, K_HEADS, V_HEADS, HEAD_DIM, KERNEL = 768, 4, 8, 64, 4
CPU = torch.device("cpu")


def layer(fuse: bool, dtype: torch.dtype, slots: int) -> GatedDeltaNet:
    """A layer with weights drawn from seed 0 (the same whichever way b and a are computed:
    the fused weight is the separate ones stacked), packed for ``dtype``."""
    built = GatedDeltaNet(
        HIDDEN, K_HEADS, V_HEADS, HEAD_DIM, HEAD_DIM, KERNEL, "silu", 1e-6, SingleRankGroup(),
        fuse_gates=fuse,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    qkvz = torch.randn(2 * (K_HEADS + V_HEADS) * HEAD_DIM, HIDDEN, generator=gen)
    ba = torch.randn(2 * V_HEADS, HIDDEN, generator=gen)
    with torch.no_grad():
        for p in built.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        if built.in_proj_ba is None:
            built.in_proj_qkvz.weight.copy_(torch.cat((qkvz, ba)) * 0.05)
        else:
            built.in_proj_qkvz.weight.copy_(qkvz * 0.05)
            built.in_proj_ba.weight.copy_(ba * 0.05)
    built.to(dtype)
    pack_linear_weights(built, CPU, dtype)
    built.bind_state(
        torch.zeros(built.conv_state_shape(slots), dtype=dtype),
        torch.zeros(built.recurrent_state_shape(slots)),
    )
    return built


def metadata(lens: list[int]) -> AttentionMetadata:
    decodes = sum(n == 1 for n in lens)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0), num_decode_tokens=decodes, decode=None, prefill=None
    )
    query_lens = torch.tensor(lens)
    meta.linear = build_linear_attention_metadata(
        query_lens,
        query_lens + (query_lens == 1) * 100,  # decodes continue sequences, prefills start
        torch.arange(1, len(lens) + 1),
        num_decodes=decodes,
        conv_kernel_size=KERNEL,
        device=CPU,
    )
    return meta


def measure(dtype: torch.dtype, lens: list[int], rounds: int, calls: int) -> str:
    """Median microseconds of each side's projections and forward, sides interleaved."""
    tokens = sum(lens)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)
    meta = metadata(lens)
    runs: dict[str, Callable[[], object]] = {}
    for side, fuse in (("apart", False), ("fused", True)):
        built = layer(fuse, dtype, len(lens))
        runs[f"proj {side}"] = partial(built._project, x)
        runs[f"layer {side}"] = partial(built, x, meta)
    timers = {what: timeit.Timer(run) for what, run in runs.items()}
    samples: dict[str, list[float]] = {what: [] for what in timers}
    with torch.no_grad():
        for timer in timers.values():
            timer.timeit(2)  # warm up
        for _ in range(rounds):
            for what, timer in timers.items():
                samples[what].append(timer.timeit(calls) / calls * 1e6)
    return "  ".join(f"{w} {statistics.median(t):.0f} us" for w, t in samples.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch threads {torch.get_num_threads()}", flush=True)
    for name in args.dtype:
        for lens in ([1] * 48, [2048]):
            # A prefill call takes ~40x a decode one: fewer calls keep the rounds alike.
            calls = args.calls if len(lens) > 1 else max(2, args.calls // 5)
            row = measure(getattr(torch, name), lens, args.rounds, calls)
            print(f"{name} tokens {sum(lens)}: {row}", flush=True)


if __name__ == "__main__":
    main()
