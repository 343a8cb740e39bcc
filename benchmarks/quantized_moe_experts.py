"""The quantized routed experts of MoE layers on CPU, int8 (W8A8, ``--scheme w8a8``) or 4-bit
(W4A16 GPTQ, ``--scheme w4a16``): each active expert's rows through the native dense kernel in
turn (the per-expert steps, one call per expert and projection, the spans read on the host)
against the grouped kernel (one call per projection for every expert, the offsets read where
they lie: ``NativeInt8.grouped_linear``, ``NativeInt4Linear.grouped_linear``), both over the
same weights, at the token counts given, interleaved (A B A B), each figure the median of
--rounds. Each round runs --layers layers of distinct weights one after the other, as a
forward pass does, so the weights come from memory as in serving (the bench shape's 4-bit
experts are 4 MiB a layer: one layer alone would stay in L3). int8: per-token dynamic
activation scales, as llm-compressor's W8A8 writes them; 4-bit: symmetric GPTQ groups of
128 inputs (AutoGPTQ's default), scales in the activations' dtype as a loaded model holds
them. Shapes: the bench MoE model (`tandem make-demo-model --kind qwen3_moe --preset bench`:
8 experts of 640, hidden 512, top 2) or Qwen3-30B-A3B's (128 experts of 768, hidden 2048,
top 8).

    python benchmarks/quantized_moe_experts.py [--scheme w4a16] [--dtype bfloat16]
        [--tokens 1 48 2048] [--shape bench] [--layers 12]
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
from tandem.core.kernels.cpu.int4_linear import native_int4_linear
from tandem.core.kernels.cpu.int8_gemm import NativeInt8, native_int8
from tandem.core.kernels.reference.fused_moe import combine, topk_softmax
from tandem.core.kernels.reference.int4_packing import PACK
from tandem.core.kernels.reference.quantized_moe import sort_by_expert
from tandem.core.layers.quant_scheme import W4A16Scheme, W8A8Scheme
from tandem.core.layers.quantized_moe import QuantizedMoeExperts

# Inputs a 4-bit group: AutoGPTQ's default.
GROUP = 128


def _int8_experts(
    experts: int, hidden: int, inter: int, gen: torch.Generator, kernels: NativeInt8
) -> QuantizedMoeExperts:
    """Random int8 experts with per-channel scales, as a checkpoint's would load, packed for
    the grouped kernel."""
    block = QuantizedMoeExperts(
        experts, hidden, inter, "silu", SingleRankGroup(), W8A8Scheme(static=False)
    )
    for projection, rows, columns in ((block.w13, 2 * inter, hidden), (block.w2, hidden, inter)):
        shape = (experts, rows, columns)
        projection.weight.data = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
        projection.weight_scale.data = torch.rand(experts, rows, 1, generator=gen) * 1e-3 + 1e-4
    block.pack_int8(kernels)
    return block


def _int4_experts(
    experts: int, hidden: int, inter: int, gen: torch.Generator, dtype: torch.dtype
) -> QuantizedMoeExperts:
    """Random symmetric GPTQ experts (groups of 128), held in the kernel layout as
    ``finish_loading`` leaves them (``layers/int4_weights.py``)."""
    scheme = W4A16Scheme(group_size=GROUP, sym=True, desc_act=False)
    block = QuantizedMoeExperts(experts, hidden, inter, "silu", SingleRankGroup(), scheme)
    for projection, rows, columns in ((block.w13, 2 * inter, hidden), (block.w2, hidden, inter)):
        int4 = projection.int4
        assert int4 is not None
        words = (experts, rows, columns // PACK)
        int4.qweight.data = torch.randint(-(2**31), 2**31 - 1, words, generator=gen).int()
        groups = (experts, rows, columns // GROUP)
        int4.scales.data = (torch.rand(groups, generator=gen) * 2e-3 + 1e-3).to(dtype)
        int4.qzeros.data = torch.full(groups, 8, dtype=torch.uint8)
        int4.g_idx.data = torch.empty(0, dtype=torch.int32)
        int4.packed = True
    return block


def _per_expert_int8(
    block: QuantizedMoeExperts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The int8 block on the per-expert steps over the same packed weights: unset, the
    grouped kernel's handle sends forward to them."""
    kernels, block._int8 = block._int8, None
    try:
        out: torch.Tensor = block(x, weights, ids)
    finally:
        block._int8 = kernels
    return out


def _per_expert_int4(
    block: QuantizedMoeExperts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The 4-bit block as it ran before the grouped call: the spans read on the host once,
    each active expert's rows through the dense kernel, projection by projection."""
    a, b = block.w13.int4, block.w2.int4
    assert a is not None and b is not None
    order, token, spans = sort_by_expert(ids, block.num_experts)
    rows = x.index_select(0, token)
    hidden = block._act(block._int4_linear(rows, spans, a.qweight, a.scales, a.qzeros, None))
    out = block._int4_linear(hidden, spans, b.qweight, b.scales, b.qzeros, None)
    return combine(x, out, order, token, weights)


def _each(calls: list[Callable[[], object]]) -> None:
    for call in calls:
        call()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheme", choices=["w8a8", "w4a16"], default="w8a8")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 48, 2048])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    experts, hidden, inter, top_k = SHAPES[args.shape]
    gen = torch.Generator().manual_seed(0)
    blocks: list[QuantizedMoeExperts] = []
    per_expert: Callable[..., torch.Tensor]
    if args.scheme == "w8a8":
        kernels = native_int8()
        if kernels is None:
            print("no native int8 kernel on this CPU (no compiler, or TANDEM_INT8=torch)")
            return 1
        blocks = [_int8_experts(experts, hidden, inter, gen, kernels) for _ in range(args.layers)]
        per_expert, name = _per_expert_int8, kernels.name
    else:
        int4 = native_int4_linear()
        if int4 is None or not int4.grouped:
            print("no native 4-bit kernel with the grouped call (no compiler, TANDEM_INT4=torch)")
            return 1
        blocks = [_int4_experts(experts, hidden, inter, gen, dtype) for _ in range(args.layers)]
        per_expert, name = _per_expert_int4, int4.compiled_path
    print(f"{args.shape} {args.scheme} experts ({experts} x {inter}, hidden {hidden}, top "
          f"{top_k}), {args.dtype} activations, {torch.get_num_threads()} threads, {name}: "
          f"per-expert calls against one grouped call per projection; ms per layer over "
          f"{args.layers} layers, median of {args.rounds} interleaved rounds")  # fmt: skip
    print(f"{'tokens':>7} {'per-expert ms':>14} {'grouped ms':>11} {'speed-up':>9} "
          f"{'grouped GOP/s':>14}")  # fmt: skip
    for tokens in args.tokens:
        print(f"  {tokens} tokens ...", file=sys.stderr, flush=True)
        x = torch.randn(tokens, hidden, generator=gen).to(dtype)
        weights, ids = topk_softmax(torch.randn(tokens, experts, generator=gen), top_k, True)
        weights = weights.to(dtype)
        grouped, old = blocks[0](x, weights, ids), per_expert(blocks[0], x, weights, ids)
        # int8: the same roundings, bit for bit. 4-bit: the same weights; the sums differ in
        # order only where an expert's rows pass the dense call's kernel_rows (dequantized
        # then torch's GEMM there), so a generous relative check catches a wrong expert.
        same = (
            torch.equal(grouped, old)
            if args.scheme == "w8a8"
            else torch.allclose(
                grouped.float(), old.float(), rtol=0.05, atol=0.05 * float(old.float().abs().max())
            )
        )
        if not same:
            print(f"the two paths differ at {tokens} tokens: not measured")
            return 1
        sides: dict[str, Callable[[], object]] = {
            "per-expert": partial(_each, [partial(per_expert, b, x, weights, ids) for b in blocks]),
            "grouped": partial(_each, [partial(b, x, weights, ids) for b in blocks]),
        }
        ms = {side: t / args.layers for side, t in _interleaved_ms(sides, args.rounds, 1).items()}
        ops = 2 * tokens * top_k * 3 * hidden * inter
        print(f"{tokens:>7} {ms['per-expert']:>14.3f} {ms['grouped']:>11.3f} "
              f"{ms['per-expert'] / ms['grouped']:>8.2f}x "
              f"{ops / ms['grouped'] / 1e6:>14.0f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
