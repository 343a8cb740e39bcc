"""Decode-step breakdown of a ~111M-parameter Qwen3-shaped model on CPU: where a step's
milliseconds go (GEMMs, attention, the rest), for float32 and bfloat16, with the old
attention path (copy every sequence's KV blocks out of the cache, then SDPA) against the
native kernel that reads the cache in place, next to the GEMM throughput this machine
reaches at the step's own shapes and to its roofline (the step's weight and K/V bytes at
the rate this machine reads memory, its GEMMs at the rate a large matmul reaches); then the
same for a prefill step of fresh prompts
(8 x 256 tokens by default), torch's SDPA on the chunks against the native prefill kernel
and, where the engine would (bfloat16 on AMX), the kernel with long chunks through the AMX
tile kernel (torch's flash attention where that kernel is not built).

    .venv/bin/python benchmarks/attention_step.py [--batch 48] [--context 384] [--steps 5]

A command that prints figures, not a test. The model has random weights (the shapes are
what matter): hidden 1024, 8 layers, 16 heads, 8 KV heads, head_dim 64, intermediate 2816,
vocab 16384 with tied embeddings (111.2M parameters: the issue's ~111M with its other
shapes fixed implies a vocabulary of ~16K).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

from tandem.collectives import SingleRankGroup
from tandem.core.kernels import attention_metadata
from tandem.core.kernels.cpu import attention_groups
from tandem.core.kernels.cpu.amx_prefill import amx_prefill
from tandem.core.kernels.cpu.flash_prefill import flash_prefill_dtypes
from tandem.core.kernels.cpu.packed_linear import PackableLinear, pack_linear_weights
from tandem.core.kernels.cpu.paged_attention import native_paged_attention
from tandem.core.kernels.cpu.prefill_attention import native_prefill_attention
from tandem.core.kernels.reference import paged_attention as attention_reference
from tandem.core.kv.cache_sizing import CacheSize
from tandem.core.layers import embedding, linear
from tandem.core.layers.attention import PagedAttention
from tandem.core.layers.replicated_linear import ReplicatedLinear
from tandem.core.llm.attention_metadata import build_attention_metadata
from tandem.core.llm.forward_input import ForwardInput, SamplingBatch
from tandem.core.llm.model_runner import ModelRunner
from tandem.core.models.causal_lm import CausalLM
from tandem.core.models.config_json import parse_model_config
from tandem.core.models.decoder import DecoderForCausalLM
from tandem.core.models.model_config import ModelConfig

BENCH_SHAPE: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 16384,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
}


class Timers:
    """Wall time per category; CPU operators run synchronously, so a timer around a call
    is the call's cost. Nested categories are subtracted from their parent."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.enabled = False

    def wrap(self, category: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.enabled:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[category] += time.perf_counter() - start

        return timed


@contextmanager
def instrumented(timers: Timers) -> Iterator[None]:
    patches = [
        (linear.ColumnParallelLinear, "forward", "gemm"),
        (linear.RowParallelLinear, "forward", "gemm"),
        # The gate/up product with SiLU-and-mul in the kernel's epilogue, where one fuses it.
        (PackableLinear, "silu_matmul", "gemm"),
        (embedding.ParallelLMHead, "compute_logits", "gemm"),
        (PagedAttention, "forward", "attention"),
    ]
    saved = [(cls, name, getattr(cls, name)) for cls, name, _ in patches]
    for cls, name, category in patches:
        setattr(cls, name, timers.wrap(category, getattr(cls, name)))
    try:
        yield
    finally:
        for cls, name, original in saved:
            setattr(cls, name, original)


def build_model(dtype: torch.dtype, seed: int) -> tuple[DecoderForCausalLM, ModelConfig]:
    config = parse_model_config(BENCH_SHAPE)
    with torch.device("meta"):
        model = DecoderForCausalLM(config, SingleRankGroup(), dtype)
    model = model.to(dtype).to_empty(device="cpu")
    # Materialising from meta unties the shared embedding; tie it again as the loader does.
    model.lm_head.weight = model.embed_tokens.weight
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()
    return model.eval(), config


def decode_step(batch: int, context: int, block_size: int, seed: int) -> tuple[ForwardInput, int]:
    """One decode step of ``batch`` sequences with contexts around ``context`` (+-1/8),
    their blocks scattered over the cache as they are after a while of serving."""
    gen = torch.Generator().manual_seed(seed)
    spread = max(context // 8, 1)
    lens = torch.randint(context - spread, context + spread + 1, (batch,), generator=gen)
    width = -(-int(lens.max()) // block_size)
    num_blocks = batch * width + 1
    tables = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(batch, width)
    positions = lens - 1
    slots = tables[torch.arange(batch), positions // block_size] * block_size
    slots += positions % block_size
    fi = ForwardInput(
        input_ids=torch.randint(0, BENCH_SHAPE["vocab_size"], (batch,), generator=gen),
        positions=positions,
        slot_mapping=slots,
        query_lens=torch.ones(batch, dtype=torch.int64),
        context_lens=lens,
        block_tables=tables,
        state_slots=torch.zeros(batch, dtype=torch.int64),
        num_decodes=batch,
        sample_indices=torch.arange(batch),
        sampling=SamplingBatch.uniform(batch),
        block_size=block_size,
    )
    return fi, num_blocks


def prefill_step(seqs: int, length: int, block_size: int, seed: int) -> tuple[ForwardInput, int]:
    """One prefill step of ``seqs`` fresh prompts of ``length`` tokens, on scattered blocks."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-length // block_size)
    num_blocks = seqs * width + 1
    tables = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(seqs, width)
    positions = torch.arange(length).repeat(seqs)
    rows = torch.arange(seqs).repeat_interleave(length)
    slots = tables[rows, positions // block_size] * block_size + positions % block_size
    fi = ForwardInput(
        input_ids=torch.randint(0, BENCH_SHAPE["vocab_size"], (seqs * length,), generator=gen),
        positions=positions,
        slot_mapping=slots,
        query_lens=torch.full((seqs,), length),
        context_lens=torch.full((seqs,), length),
        block_tables=tables,
        state_slots=torch.zeros(seqs, dtype=torch.int64),
        num_decodes=0,
        sample_indices=torch.arange(1, seqs + 1) * length - 1,
        sampling=SamplingBatch.uniform(seqs),
        block_size=block_size,
    )
    return fi, num_blocks


def sdpa_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: attention_metadata.AttentionGroup,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """What fresh prefill chunks ran before the native kernel: torch's causal SDPA over each
    chunk's own q/k/v (equal-length chunks, viewed without copies)."""
    assert group.query_index is not None
    batch, length = group.query_index.shape
    heads, head_dim, kv_heads = q.shape[1], q.shape[2], k.shape[1]
    qp = q.view(batch, length, heads, head_dim).transpose(1, 2)
    kp = k.view(batch, length, kv_heads, head_dim).transpose(1, 2)
    vp = v.view(batch, length, kv_heads, head_dim).transpose(1, 2)
    o = torch.nn.functional.scaled_dot_product_attention(
        qp, kp, vp, is_causal=True, scale=scale, enable_gqa=heads != kv_heads
    )
    out.view(batch, length, heads, head_dim).copy_(o.transpose(1, 2))
    return out


def use_prefill_path(model: CausalLM, dtype: torch.dtype, path: str) -> None:
    """``path``: "sdpa" (torch's SDPA on every chunk), "native" (the native kernel on every
    chunk) or "serving" (what the engine picks on this CPU: long chunks through the AMX tile
    kernel or torch's flash attention where that is faster, see
    ``kernels/cpu/flash_prefill.py``)."""
    kernel = native_prefill_attention()
    for layer in model.attention_layers():
        if path == "sdpa":
            impl = sdpa_prefill
        else:
            assert kernel is not None
            flash = None if path == "serving" else frozenset[torch.dtype]()
            impl = attention_groups.native_prefill(kernel, flash_dtypes=flash)
        layer._prefill._resolved = (dtype, impl)


def use_path(model: CausalLM, dtype: torch.dtype, native: bool) -> None:
    kernel = native_paged_attention()
    for layer in model.attention_layers():
        if native:
            assert kernel is not None
            impl = attention_groups.native_decode(kernel)
        else:
            impl = attention_reference.reference_decode
        layer._decode._resolved = (dtype, impl)


def run_steps(
    fi: ForwardInput,
    steps: int,
    timers: Timers,
    paths: Sequence[tuple[ModelRunner, Callable[[], None]]],
) -> list[dict[str, float]]:
    """Median ms per step of each category, per path (a runner and how its attention is set
    up), over ``steps`` timed steps each (after two warm-up steps): the forward, the logits
    and greedy choice, as the runner does them. The paths take turns step by step, so load
    from other processes falls on all of them alike instead of on whichever ran during a
    busy second."""

    def one_step(runner: ModelRunner) -> None:
        meta = build_attention_metadata(fi, runner.device)
        hidden = runner.model(fi.input_ids, fi.positions, meta)
        logits = runner.model.compute_logits(hidden[fi.sample_indices])
        logits.argmax(dim=-1)

    per_step: list[dict[str, list[float]]] = [defaultdict(list) for _ in paths]
    with torch.inference_mode():
        for runner, use in paths:
            use()
            for _ in range(2):
                one_step(runner)
        for _ in range(steps):
            for (runner, use), figures in zip(paths, per_step, strict=True):
                use()
                timers.totals.clear()
                timers.enabled = True
                start = time.perf_counter()
                one_step(runner)
                total = time.perf_counter() - start
                timers.enabled = False
                figures["step"].append(total)
                for name in ("gemm", "attention"):
                    figures[name].append(timers.totals[name])
                figures["other"].append(total - timers.totals["gemm"] - timers.totals["attention"])
    return [
        {name: statistics.median(values) * 1e3 for name, values in figures.items()}
        for figures in per_step
    ]


def prefill_breakdown(
    args: argparse.Namespace, dtypes: list[torch.dtype], config: ModelConfig, timers: Timers
) -> None:
    if native_prefill_attention() is None:
        return
    tokens = args.prefill_seqs * args.prefill_len
    print()
    print(f"step: prefill, {args.prefill_seqs} fresh prompts of {args.prefill_len} tokens")
    header = (
        f"{'dtype':9} {'attention':17} {'step ms':>8} {'GEMM ms':>8} {'attn ms':>8} "
        f"{'other ms':>8} {'GEMM GFLOP/s':>13}"
    )
    print(header)
    print("-" * len(header))
    fi, num_blocks = prefill_step(args.prefill_seqs, args.prefill_len, args.block_size, args.seed)
    # Logits only for each prompt's last token, as the runner computes them.
    flops = gemm_flops(config, tokens) - 2.0 * (tokens - args.prefill_seqs) * (
        config.hidden_size * config.vocab_size
    )
    for dtype in dtypes:
        model, _ = build_model(dtype, args.seed)
        pack_linear_weights(model, torch.device("cpu"), dtype)
        runner = ModelRunner(model, torch.device("cpu"), dtype, seed=0, samples=False)
        runner.init_kv_cache(CacheSize(num_blocks), args.block_size, prefault=True)
        paths = [("torch SDPA", "sdpa"), ("native kernel", "native")]
        if dtype in flash_prefill_dtypes():
            long_chunks = "tiles" if amx_prefill() is not None else "flash"
            paths.append((f"native + {long_chunks}", "serving"))
        uses = [(runner, partial(use_prefill_path, model, dtype, path)) for _, path in paths]
        with instrumented(timers):
            results = run_steps(fi, max(3, args.steps // 2), timers, uses)
        for (label, _), r in zip(paths, results, strict=True):
            print(
                f"{str(dtype).removeprefix('torch.'):9} {label:17} {r['step']:8.1f} "
                f"{r['gemm']:8.1f} {r['attention']:8.1f} {r['other']:8.1f} "
                f"{flops / r['gemm'] / 1e6:13.0f}"
            )
        del runner, uses, model


def gemm_flops(config: ModelConfig, tokens: int) -> float:
    h, q = config.hidden_size, config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    per_layer = h * (q + 2 * kv) + q * h + h * 2 * config.intermediate_size
    per_layer += config.intermediate_size * h
    return 2.0 * tokens * (config.num_layers * per_layer + h * config.vocab_size)


def gemm_shapes(config: ModelConfig) -> list[tuple[str, int, int]]:
    h, q = config.hidden_size, config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    return [
        ("qkv_proj", h, q + 2 * kv),
        ("o_proj", q, h),
        ("gate_up_proj", h, 2 * config.intermediate_size),
        ("down_proj", config.intermediate_size, h),
        ("lm_head", h, config.vocab_size),
    ]


def measure_gemm(
    rows: int, k: int, n: int, dtype: torch.dtype, packed: bool, seconds: float = 0.25
) -> float:
    """GFLOP/s of ``x @ w.T`` for x [rows, k], w [n, k], as the model runs it: ``F.linear``
    on a plain weight, or oneDNN on the weight packed at load."""
    layer = ReplicatedLinear(k, n)
    layer.weight.data = torch.randn(n, k).to(dtype)
    if packed and not pack_linear_weights(layer, torch.device("cpu"), dtype):
        return float("nan")
    x = torch.randn(rows, k).to(dtype)
    layer(x)
    reps = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        layer(x)
        reps += 1
    elapsed = time.perf_counter() - start
    return 2.0 * rows * k * n * reps / elapsed / 1e9


def measure_read_bandwidth(megabytes: int = 512) -> float:
    """GB/s at which this machine's threads read memory: torch's float32 sum (a vectorized
    read, one add a value) over a buffer far past any cache, best of five."""
    buffer = torch.ones(megabytes << 18, dtype=torch.float32)
    buffer.sum()
    best = min(_timed(buffer.sum) for _ in range(5))
    return buffer.numel() * 4 / best / 1e9


def measure_matmul_peak(dtype: torch.dtype, size: int = 2048) -> float:
    """GFLOP/s of a large square matmul with its operands in cache (oneDNN's best case:
    what the CPU's matrix units or FMAs give a GEMM), best of five."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(5))
    return 2.0 * size**3 / best / 1e9


def _timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def step_bytes(config: ModelConfig, fi: ForwardInput, dtype: torch.dtype) -> tuple[int, int]:
    """What a decode step must read at least: every weight once (the embedding rows it
    looks up aside) and every sequence's K and V, in bytes."""
    size = torch.empty((), dtype=dtype).element_size()
    params = gemm_flops(config, 1) / 2
    kv = int(fi.context_lens.sum()) * config.num_kv_heads * config.head_dim * 2
    return int(params * size), kv * config.num_layers * size


def roofline(
    config: ModelConfig,
    fi: ForwardInput,
    dtypes: Sequence[torch.dtype],
    measured: dict[torch.dtype, dict[str, float]],
) -> None:
    """The packed, in-place decode step against the rates this machine gives: memory read
    for the weights (GEMMs at decode batch sizes stream them) and the K/V (attention), a
    large matmul's for the GEMMs' arithmetic."""
    bandwidth = measure_read_bandwidth()
    print()
    print(
        f"roofline: memory read {bandwidth:.1f} GB/s (float32 sum over 512 MB, "
        f"{torch.get_num_threads()} threads)"
    )
    header = (
        f"{'dtype':9} {'matmul GFLOP/s':>14} {'weights MB':>10} {'K/V MB':>7} "
        f"{'floor ms':>8} {'step ms':>8} {'reached':>7} {'GEMM GB/s':>9} {'attn GB/s':>9}"
    )
    print(header)
    print("-" * len(header))
    flops = gemm_flops(config, fi.num_decodes)
    for dtype in dtypes:
        step = measured.get(dtype)
        if step is None:
            continue
        peak = measure_matmul_peak(dtype)
        weights, kv = step_bytes(config, fi, dtype)
        # The step cannot take less than its bytes at the read rate, nor its GEMMs less
        # than their arithmetic at the matmul rate.
        floor = max((weights + kv) / bandwidth / 1e6, flops / peak / 1e6)
        print(
            f"{str(dtype).removeprefix('torch.'):9} {peak:14.0f} {weights / 1e6:10.1f} "
            f"{kv / 1e6:7.1f} {floor:8.1f} {step['step']:8.1f} {floor / step['step']:7.0%} "
            f"{weights / step['gemm'] / 1e6:9.1f} {kv / step['attention'] / 1e6:9.1f}"
        )


def measure_small_op(rows: int, width: int, dtype: torch.dtype, threads: int) -> float:
    """Microseconds of one small elementwise op (a decode step runs hundreds): what an
    intra-op parallel region costs when the cores are shared with other work."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.randn(rows, width).to(dtype)
        for _ in range(10):
            x * x
        reps = 0
        start = time.perf_counter()
        while time.perf_counter() - start < 0.1:
            x * x
            reps += 1
        return (time.perf_counter() - start) / reps * 1e6
    finally:
        torch.set_num_threads(before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument("--context", type=int, default=384)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=7, help="timed steps per path")
    parser.add_argument("--threads", type=int, default=None, help="default: torch's")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefill-seqs", type=int, default=8)
    parser.add_argument("--prefill-len", type=int, default=256)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = [getattr(torch, name.strip()) for name in args.dtypes.split(",")]
    kernel = native_paged_attention()

    config = parse_model_config(BENCH_SHAPE)
    params = sum(p.numel() for p in build_model(torch.float32, args.seed)[0].parameters())
    print(
        f"model: Qwen3-shaped, {params / 1e6:.1f}M parameters (hidden {config.hidden_size}, "
        f"{config.num_layers} layers, {config.num_heads}/{config.num_kv_heads} heads, "
        f"head_dim {config.head_dim}, intermediate {config.intermediate_size}, "
        f"vocab {config.vocab_size}, tied)"
    )
    print(
        f"step: decode, batch {args.batch}, context {args.context} +-{args.context // 8}, "
        f"block size {args.block_size}; {torch.get_num_threads()} threads; "
        f"{platform.processor() or platform.machine()}; torch {torch.__version__}"
    )
    print(f"native kernel: {kernel.path if kernel else 'unavailable (reference path only)'}")
    # Other processes on the cores make every figure below slower and noisier.
    print("load average before: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    print()
    fi, num_blocks = decode_step(args.batch, args.context, args.block_size, args.seed)
    flops = gemm_flops(config, args.batch)
    header = (
        f"{'dtype':9} {'attention, weights':17} {'step ms':>8} {'GEMM ms':>8} {'attn ms':>8} "
        f"{'other ms':>8} {'GEMM GFLOP/s':>13}"
    )
    print(header)
    print("-" * len(header))
    timers = Timers()
    # The packed, in-place path's step per dtype, for the roofline below.
    packed_steps: dict[torch.dtype, dict[str, float]] = {}
    for dtype in dtypes:
        runners = {}
        for weights in ("plain", "packed"):
            model, _ = build_model(dtype, args.seed)
            if weights == "packed":
                pack_linear_weights(model, torch.device("cpu"), dtype)
            runner = ModelRunner(model, torch.device("cpu"), dtype, seed=0, samples=False)
            runner.init_kv_cache(CacheSize(num_blocks), args.block_size, prefault=True)
            with torch.no_grad():
                for k_cache, v_cache in runner.kv_caches:
                    k_cache.normal_()
                    v_cache.normal_()
            runners[weights] = runner
        # (label, weights, attention in place): before this work, then each change on its own.
        paths = [("copy, plain", "plain", False)]
        if kernel:
            paths += [("in place, plain", "plain", True), ("in place, packed", "packed", True)]
        uses = [
            (runners[weights], partial(use_path, runners[weights].model, dtype, native))
            for _, weights, native in paths
        ]
        with instrumented(timers):
            results = run_steps(fi, args.steps, timers, uses)
            for (label, weights, native), r in zip(paths, results, strict=True):
                if weights == "packed" and native:
                    packed_steps[dtype] = r
                print(
                    f"{str(dtype).removeprefix('torch.'):9} {label:17} {r['step']:8.1f} "
                    f"{r['gemm']:8.1f} {r['attention']:8.1f} {r['other']:8.1f} "
                    f"{flops / r['gemm'] / 1e6:13.0f}"
                )
        del runners, uses
    roofline(config, fi, dtypes, packed_steps)
    prefill_breakdown(args, dtypes, config, timers)
    print()
    print(f"GEMM throughput at the step's shapes (x [{args.batch}, k] @ w.T), GFLOP/s:")
    print(
        f"{'layer':14} {'k x n':>12} "
        + " ".join(f"{str(d)[6:] + ' ' + w:>16}" for d in dtypes for w in ("plain", "packed"))
    )
    for name, k, n in gemm_shapes(config):
        rates = [
            measure_gemm(args.batch, k, n, dtype, packed)
            for dtype in dtypes
            for packed in (False, True)
        ]
        print(f"{name:14} {f'{k}x{n}':>12} " + " ".join(f"{r:16.0f}" for r in rates))
    big = [measure_gemm(1024, 1024, 2816, d, packed) for d in dtypes for packed in (False, True)]
    print(f"{'(prefill-size)':14} {'1024 rows':>12} " + " ".join(f"{r:16.0f}" for r in big))
    threads = sorted({1, torch.get_num_threads()})
    print()
    print(f"one elementwise op (x * x, x [{args.batch}, {config.hidden_size}]), us:")
    for count in threads:
        costs = [measure_small_op(args.batch, config.hidden_size, d, count) for d in dtypes]
        print(f"{f'{count} threads':27} " + " ".join(f"{c:9.1f}" for c in costs))
    print("load average after: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))


if __name__ == "__main__":
    main()
