"""The device check: serve the dense, hybrid and MoE bench models on an accelerator with its
kernel families (Triton on CUDA; torch_npu's fused ops, then Triton, on Ascend), check greedy
tokens against the CPU float32 path, time every model kernel against its torch reference at
the model's own shapes, and measure output tok/s on the bench workload.

On a CUDA machine with one GPU, from the repository root, nothing to install beyond torch
and triton (the script registers the hardware runtime itself, so tandem's packages need no
``pip install``; benchmarks/device_check.md has the recipe for a machine without a registry
and what to expect):

    PYTHONPATH=packages/device:packages/collectives:packages/core:hw \
        python3 benchmarks/device_check.py --device cuda --out $OUT

``--device npu`` is the same on Ascend NPUs (torch_npu and CANN installed, triton-ascend for
the Triton family). Without any device, ``--device standin`` runs it all on CPU as if on two
Ascend NPUs (``tandem_sim.as_npu``: the fake NPU runtime on real threads, the torch_npu
stand-in, Triton under its interpreter; ``TRITON_INTERPRET=1`` must be set before Python
starts), TP=2 in one process, on tiny models and a handful of tokens: it proves the check
starts, checks tokens and times the kernels; its speeds mean nothing.

    TRITON_INTERPRET=1 python benchmarks/device_check.py --device standin

What it prints, per model:

1. Tokens: each prompt's greedy tokens on the device (in float32) against the CPU float32
   path, ``equal``, ``near-tie`` or ``MISMATCH``. The near-tie rule: the two token lists may
   differ only from a position where the CPU run's two most likely tokens are within
   ``--tie-margin`` nats of each other (default 0.01) and the device chose the CPU's second;
   after that position the contexts differ and nothing more is compared. Both runs ask for
   the top-2 logprobs of every generated token; the largest difference of the chosen
   token's logprob while the tokens agree is printed too. Float32 stays float32 on CUDA for
   the check: torch's TF32 switches are turned off and Triton's float32 ``tl.dot`` defaults
   to IEEE (``TRITON_F32_DEFAULT=ieee``; the kernels also ask for it where it matters), so
   the differences left are the order of float32 sums, far inside the margin.
2. Kernels: every kernel of ``tandem/core/kernels/handles.py`` the model calls, with the
   arguments captured from one decode step (``--decode-batch`` sequences at about
   ``--context`` tokens) and one prefill step (``--prefill-seqs`` x ``--prefill-len``) of
   the model itself at TP=1 in ``--dtype``, the family the device chooses against the
   reference (``handle.impl``): median of ``--reps`` after ``--warmup`` (device events on
   an accelerator, wall clock on the stand-in), the speedup, and the largest difference of
   their outputs.
3. Throughput: output tok/s of offline generation in ``--dtype`` on the bench workload
   (``--bench-prompts`` prompts, ``--bench-concurrency`` at once, ``--bench-in`` random
   prompt tokens, ``--bench-out`` generated, as benchmarks/compare.py), after a warm-up.

The exit status is 1 if any prompt is a MISMATCH, else 0. ``--out DIR`` writes all of it to
``DIR/device_check.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("device_check")

MODEL_NAMES = ("dense", "hybrid", "moe")
# The stand-in: two NPUs in one process, TP=2.
STANDIN_DEVICES = "npu:0,npu:1"


@dataclass(frozen=True)
class Sizes:
    """What one mode runs: models, workloads and repetitions."""

    check_prompts: int
    check_tokens: int
    check_prompt_len: tuple[int, int]
    decode_batch: int
    context: int
    prefill_seqs: int
    prefill_len: int
    warmup: int
    reps: int
    bench_prompts: int
    bench_concurrency: int
    bench_in: int
    bench_out: int


DEVICE_SIZES = Sizes(
    check_prompts=16, check_tokens=32, check_prompt_len=(16, 200),
    decode_batch=48, context=384, prefill_seqs=8, prefill_len=256, warmup=3, reps=20,
    bench_prompts=96, bench_concurrency=48, bench_in=256, bench_out=128,
)  # fmt: skip
# The stand-in runs the Triton kernels under the interpreter, where one launch takes as long
# as a whole step on a device: tiny models (written with weights wide enough, std 0.2, that
# greedy choices are separated by real margins) and a handful of tokens.
STANDIN_SIZES = Sizes(
    check_prompts=2, check_tokens=4, check_prompt_len=(5, 9),
    decode_batch=2, context=12, prefill_seqs=1, prefill_len=8, warmup=1, reps=2,
    bench_prompts=2, bench_concurrency=2, bench_in=8, bench_out=4,
)  # fmt: skip


# -- models ---------------------------------------------------------------------------------


def write_model(name: str, preset: str, folder: Path) -> Path:
    """The model ``name`` (dense, hybrid, moe) in ``preset`` (bench: the benchmarks' ~100M
    models; tiny: a few layers of width 64, for the stand-in), written once."""
    from tandem.core.demo.demo_model import PRESETS, tiny_spec, write_demo_model
    from tandem.core.demo.family_demo_model import (
        QWEN3_5_PRESETS,
        QWEN3_MOE_PRESETS,
        write_qwen3_5_demo_model,
        write_qwen3_moe_demo_model,
    )

    if (folder / "config.json").exists():
        return folder
    logger.info("writing the %s %s model to %s", preset, name, folder)
    tiny = preset == "tiny"
    if name == "dense":
        return write_demo_model(folder, tiny_spec() if tiny else PRESETS[preset])
    if name == "hybrid":
        spec = QWEN3_5_PRESETS["demo" if tiny else preset]
        if tiny:
            spec = replace(
                spec, hidden_size=64, intermediate_size=128, num_layers=2,
                full_attention_interval=2, num_heads=4, num_kv_heads=2, head_dim=32,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=16, vocab_size=512, max_position_embeddings=512,
                init_std=0.2,
            )  # fmt: skip
        return write_qwen3_5_demo_model(folder, spec)
    moe = QWEN3_MOE_PRESETS["demo" if tiny else preset]
    if tiny:
        moe = replace(
            moe, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
            num_experts=4, moe_intermediate_size=64, vocab_size=512,
            max_position_embeddings=512, init_std=0.2,
        )  # fmt: skip
    return write_qwen3_moe_demo_model(folder, moe)


# -- engines --------------------------------------------------------------------------------


def engine_config(
    folder: Path,
    devices: str,
    dtype: str,
    num_blocks: int,
    max_seqs: int,
) -> Any:
    from tandem.core import CacheConfig, EngineConfig, ModelLoadConfig, SchedulerConfig
    from tandem.core.config import ParallelConfig

    return EngineConfig(
        model=ModelLoadConfig(model=str(folder), dtype=dtype),
        cache=CacheConfig(num_blocks=num_blocks, enable_prefix_cache=False),
        scheduler=SchedulerConfig(max_tokens_per_batch=2048, max_seqs_per_batch=max_seqs),
        parallel=ParallelConfig(devices=devices, single_process=True),
    )


def generate(config: Any, prompts: list[list[int]], params: Any) -> tuple[list[Any], float]:
    """The outputs of the engine's offline generate, and its seconds (engine start and stop
    not counted)."""
    from tandem.core import LLMEngine

    engine = LLMEngine(config)
    try:
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        return outputs, time.perf_counter() - start
    finally:
        engine.shutdown()


def random_prompts(vocab: int, count: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    low, high = lengths
    sizes = torch.randint(low, high + 1, (count,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in sizes]


def blocks_for(prompts: int, tokens: int, block_size: int = 16) -> int:
    return prompts * (-(-tokens // block_size) + 1) + 1


# -- tokens ---------------------------------------------------------------------------------


@dataclass
class Verdict:
    prompt: int
    verdict: str  # "equal", "near-tie" or "MISMATCH"
    position: int | None = None  # the first position that differs
    cpu_token: int | None = None
    device_token: int | None = None
    cpu_margin: float | None = None  # the CPU's top-1 minus the device token's logprob
    detail: str = ""


def compare_tokens(
    cpu: Sequence[Any], device: Sequence[Any], tie_margin: float
) -> tuple[list[Verdict], float]:
    """Each prompt's verdict, and the largest |logprob difference| of the chosen token over
    the positions where both runs agree."""
    verdicts: list[Verdict] = []
    largest = 0.0
    for index, (a, b) in enumerate(zip(cpu, device, strict=True)):
        first = next(
            (i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y),
            None,
        )
        agree = len(a.token_ids) if first is None else first
        if a.logprobs and b.logprobs:
            for i in range(min(agree, len(a.logprobs), len(b.logprobs))):
                largest = max(largest, abs(a.logprobs[i].logprob - b.logprobs[i].logprob))
        if first is None:
            same = len(a.token_ids) == len(b.token_ids)
            verdicts.append(
                Verdict(index, "equal" if same else "MISMATCH",
                        detail="" if same else "the lengths differ")
            )  # fmt: skip
            continue
        cpu_token, device_token = a.token_ids[first], b.token_ids[first]
        top = dict(a.logprobs[first].top) if a.logprobs else {}
        margin = top[cpu_token] - top[device_token] if device_token in top else None
        tie = margin is not None and margin <= tie_margin
        detail = (
            f"the device chose the CPU's runner-up, {margin:.2e} nats behind"
            if margin is not None
            else "the device's token is not among the CPU's top 2"
        )
        verdicts.append(
            Verdict(index, "near-tie" if tie else "MISMATCH", first, cpu_token, device_token,
                    margin, detail)
        )  # fmt: skip
    return verdicts, largest


# -- kernels --------------------------------------------------------------------------------


@dataclass
class Captured:
    handle: Any
    phase: str
    args: tuple[Any, ...]


@contextmanager
def capturing(phase: list[str], calls: dict[tuple[str, str, str], Captured]) -> Iterator[None]:
    """Record the first call of each kernel in each phase (its tensor arguments copied, as
    the forward goes on to change some of them in place)."""
    from tandem.core.kernels.handle import KernelHandle

    original = KernelHandle.__call__

    def record(self: Any, x: torch.Tensor, *args: Any) -> Any:
        key = (self.name, self.variant, phase[0])
        if key not in calls:
            copied = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in (x, *args))
            calls[key] = Captured(self, phase[0], copied)
        return original(self, x, *args)

    KernelHandle.__call__ = record  # type: ignore[method-assign]
    try:
        yield
    finally:
        KernelHandle.__call__ = original  # type: ignore[method-assign]


def decode_input(batch: int, context: int, vocab: int, base_block: int, seed: int) -> Any:
    """One decode step of ``batch`` sequences at about ``context`` tokens (+-1/8), their
    blocks scattered from ``base_block`` on, each with a state slot of its own."""
    from tandem.core.llm.forward_input import ForwardInput, SamplingBatch

    block_size = 16
    gen = torch.Generator().manual_seed(seed)
    spread = max(context // 8, 1)
    lens = torch.randint(max(context - spread, 1), context + spread + 1, (batch,), generator=gen)
    width = -(-int(lens.max()) // block_size)
    tables = (torch.randperm(batch * width, generator=gen) + base_block).view(batch, width)
    positions = lens - 1
    slots = tables[torch.arange(batch), positions // block_size] * block_size
    slots += positions % block_size
    return ForwardInput(
        input_ids=torch.randint(0, vocab, (batch,), generator=gen),
        positions=positions,
        slot_mapping=slots,
        query_lens=torch.ones(batch, dtype=torch.int64),
        context_lens=lens,
        block_tables=tables,
        state_slots=torch.arange(1, batch + 1),
        num_decodes=batch,
        sample_indices=torch.arange(batch),
        sampling=SamplingBatch.uniform(batch),
        block_size=block_size,
    )


def prefill_input(seqs: int, length: int, vocab: int, base_block: int, seed: int) -> Any:
    from tandem.core.llm.forward_input import ForwardInput, SamplingBatch

    block_size = 16
    gen = torch.Generator().manual_seed(seed)
    width = -(-length // block_size)
    tables = (torch.randperm(seqs * width, generator=gen) + base_block).view(seqs, width)
    positions = torch.arange(length).repeat(seqs)
    rows = torch.arange(seqs).repeat_interleave(length)
    slots = tables[rows, positions // block_size] * block_size + positions % block_size
    return ForwardInput(
        input_ids=torch.randint(0, vocab, (seqs * length,), generator=gen),
        positions=positions,
        slot_mapping=slots,
        query_lens=torch.full((seqs,), length),
        context_lens=torch.full((seqs,), length),
        block_tables=tables,
        state_slots=torch.arange(1, seqs + 1),
        num_decodes=0,
        sample_indices=torch.arange(1, seqs + 1) * length - 1,
        sampling=SamplingBatch.uniform(seqs),
        block_size=block_size,
    )


def capture_kernel_calls(
    folder: Path, kind: str, dtype: torch.dtype, sizes: Sizes
) -> list[Captured]:
    """Load the model at TP=1 on device ``kind``:0, bound to this thread as a worker binds
    its own, and run one decode and one prefill step, recording each kernel's arguments."""
    from tandem.collectives import SingleRankGroup
    from tandem.core.kv.cache_sizing import CacheSize
    from tandem.core.llm.model_runner import ModelRunner
    from tandem.core.models.config_json import load_model_config
    from tandem.core.models.loader import load_model
    from tandem.device import (
        BoundContext,
        Device,
        bind_context,
        get_runtime,
        process_kernel_registry,
    )

    runtime = get_runtime(kind)
    device = Device(kind, 0)
    runtime.bind(device)
    bind_context(BoundContext(runtime, process_kernel_registry()))
    torch_device = runtime.torch_device(device)
    config = load_model_config(folder)
    model = load_model(folder, config, SingleRankGroup(), dtype, torch_device)
    runner = ModelRunner(model, torch_device, dtype, seed=0, samples=True)
    decode_blocks = sizes.decode_batch * -(-(sizes.context + sizes.context // 8 + 1) // 16)
    prefill_blocks = sizes.prefill_seqs * -(-sizes.prefill_len // 16)
    slots = max(sizes.decode_batch, sizes.prefill_seqs) + 1
    runner.init_kv_cache(CacheSize(1 + decode_blocks + prefill_blocks, slots), 16, prefault=False)
    steps = [
        ("decode", decode_input(sizes.decode_batch, sizes.context, config.vocab_size, 1, 0)),
        ("prefill", prefill_input(sizes.prefill_seqs, sizes.prefill_len, config.vocab_size,
                                  1 + decode_blocks, 1)),
    ]  # fmt: skip
    calls: dict[tuple[str, str, str], Captured] = {}
    phase = [""]
    with capturing(phase, calls):
        for name, fi in steps:
            phase[0] = name
            runner.execute(fi)
    runtime.synchronize()
    return list(calls.values())


@dataclass
class KernelRow:
    kernel: str
    phase: str
    shape: str
    family: str
    ref_ms: float
    kernel_ms: float
    speedup: float
    max_abs_diff: float


def chosen_family(handle: Any, families: Sequence[str], dtype: torch.dtype) -> tuple[str, Any]:
    """The family ``handle.choose`` would take on a runtime listing ``families``, and its
    kernel (the reference's where none serves the dtype)."""
    for family in families:
        choice = handle.families.get(family)
        fn = choice(dtype) if choice is not None else None
        if fn is not None:
            return family, fn
    return "reference", handle.impl


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for item in value for t in _tensors(item)]
    return []


def _max_diff(a: Any, b: Any) -> float:
    pairs = list(zip(_tensors(a), _tensors(b), strict=False))
    if not pairs:
        return float("nan")
    return max(float((x.float() - y.float()).abs().max()) if x.numel() else 0.0 for x, y in pairs)


class Timer:
    """Milliseconds of one call: the device's events on an accelerator, else wall clock
    around the call and a synchronize."""

    def __init__(self, kind: str, standin: bool) -> None:
        self.module: Any = None if standin or kind == "cpu" else getattr(torch, kind)

    def sync(self) -> None:
        if self.module is not None:
            self.module.synchronize()

    def time(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        if self.module is None:
            start = time.perf_counter()
            out = fn()
            return (time.perf_counter() - start) * 1e3, out
        begin = self.module.Event(enable_timing=True)
        end = self.module.Event(enable_timing=True)
        begin.record()
        out = fn()
        end.record()
        end.synchronize()
        return float(begin.elapsed_time(end)), out


def time_kernels(
    calls: list[Captured], families: Sequence[str], timer: Timer, sizes: Sizes
) -> list[KernelRow]:
    rows = []
    for call in calls:
        handle = call.handle
        dtype = call.args[0].dtype
        family, kernel = chosen_family(handle, families, dtype)

        def run(fn: Callable[..., Any], call: Captured = call) -> Any:
            # Fresh copies each time: several kernels write into their arguments.
            args = [a.clone() if isinstance(a, torch.Tensor) else a for a in call.args]
            timer.sync()
            return timer.time(lambda: fn(*args))

        figures: dict[str, list[float]] = {"ref": [], "kernel": []}
        outputs: dict[str, Any] = {}
        with torch.inference_mode():
            for _ in range(sizes.warmup):
                run(handle.impl)
                run(kernel)
            for _ in range(sizes.reps):
                # Taking turns, so that load from elsewhere falls on both alike.
                for label, fn in (("ref", handle.impl), ("kernel", kernel)):
                    ms, outputs[label] = run(fn)
                    figures[label].append(ms)
        ref_ms = statistics.median(figures["ref"])
        kernel_ms = statistics.median(figures["kernel"])
        first = call.args[0]
        rows.append(
            KernelRow(
                kernel=handle.name + (f"[{handle.variant}]" if handle.variant else ""),
                phase=call.phase,
                shape="x".join(str(d) for d in first.shape)
                + f" {str(dtype).removeprefix('torch.')}",
                family=family,
                ref_ms=ref_ms,
                kernel_ms=kernel_ms,
                speedup=ref_ms / kernel_ms if kernel_ms > 0 else float("nan"),
                max_abs_diff=_max_diff(outputs["ref"], outputs["kernel"]),
            )
        )
        logger.info("timed %s (%s)", rows[-1].kernel, call.phase)
    return rows


# -- the check ------------------------------------------------------------------------------


@dataclass
class ModelResult:
    name: str
    folder: str
    architecture: str
    verdicts: list[Verdict] = field(default_factory=list)
    max_logprob_diff: float = 0.0
    cpu_s: float = 0.0
    device_check_s: float = 0.0
    kernels: list[KernelRow] = field(default_factory=list)
    workload: str = ""
    output_tok_s: float = 0.0
    total_tok_s: float = 0.0
    bench_s: float = 0.0


def check_model(name: str, folder: Path, args: argparse.Namespace, sizes: Sizes) -> ModelResult:
    from tandem.core import SamplingParams
    from tandem.core.models.config_json import load_model_config

    config = load_model_config(folder)
    result = ModelResult(name, str(folder), config.architecture)

    # 1. Greedy tokens, device float32 against CPU float32.
    prompts = random_prompts(
        config.vocab_size, sizes.check_prompts, sizes.check_prompt_len, args.seed
    )
    params = SamplingParams.greedy(sizes.check_tokens, ignore_eos=True, logprobs=2)
    blocks = blocks_for(len(prompts), sizes.check_prompt_len[1] + sizes.check_tokens)
    max_seqs = len(prompts)
    logger.info("%s: the CPU float32 reference (%d prompts)", name, len(prompts))
    cpu, result.cpu_s = generate(
        engine_config(folder, "cpu:0", "float32", blocks, max_seqs), prompts, params
    )
    logger.info("%s: the device in float32 on %s", name, args.devices)
    device, result.device_check_s = generate(
        engine_config(folder, args.devices, "float32", blocks, max_seqs), prompts, params
    )
    result.verdicts, result.max_logprob_diff = compare_tokens(cpu, device, args.tie_margin)

    # 2. Kernels against their references, at the model's shapes in the bench dtype.
    logger.info("%s: capturing the kernels' arguments (%s)", name, args.dtype)
    calls = capture_kernel_calls(folder, args.kind, getattr(torch, args.dtype), sizes)
    families = _families(args.kind)
    result.kernels = time_kernels(calls, families, Timer(args.kind, args.standin), sizes)
    del calls
    _empty_cache(args.kind, args.standin)

    # 3. Output tok/s on the bench workload.
    if args.standin:
        # Under the interpreter a bench-size run would take hours: the check's own run,
        # which is the tiny workload, stands for it.
        generated = sum(len(o.token_ids) for o in device)
        fed = sum(len(p) for p in prompts)
        result.workload = (
            f"stand-in, tiny: {len(prompts)} prompts, {sizes.check_tokens} out, float32 "
            "(Triton interpreted: the speed means nothing)"
        )
        result.bench_s = result.device_check_s
    else:
        bench = random_prompts(
            config.vocab_size, sizes.bench_prompts, (sizes.bench_in, sizes.bench_in), args.seed + 1
        )
        bench_params = SamplingParams.greedy(sizes.bench_out, ignore_eos=True)
        blocks = blocks_for(sizes.bench_concurrency, sizes.bench_in + sizes.bench_out) + 64
        cfg = engine_config(folder, args.devices, args.dtype, blocks, sizes.bench_concurrency)
        logger.info("%s: the bench workload in %s", name, args.dtype)
        from tandem.core import LLMEngine

        engine = LLMEngine(cfg)
        try:
            # Warm-up: the kernels compile for the workload's shapes on first use.
            engine.generate(
                bench[: sizes.bench_concurrency], SamplingParams.greedy(4, ignore_eos=True)
            )
            start = time.perf_counter()
            outputs = engine.generate(bench, bench_params)
            result.bench_s = time.perf_counter() - start
        finally:
            engine.shutdown()
        generated = sum(len(o.token_ids) for o in outputs)
        fed = sum(len(p) for p in bench)
        result.workload = (
            f"{sizes.bench_prompts} prompts, {sizes.bench_concurrency} concurrent, "
            f"{sizes.bench_in} in / {sizes.bench_out} out, {args.dtype}"
        )
        _empty_cache(args.kind, args.standin)
    result.output_tok_s = generated / result.bench_s
    result.total_tok_s = (generated + fed) / result.bench_s
    return result


def _families(kind: str) -> tuple[str, ...]:
    from tandem.device import get_runtime

    return tuple(get_runtime(kind).kernel_families)


def _empty_cache(kind: str, standin: bool) -> None:
    if not standin and kind != "cpu":
        getattr(torch, kind).empty_cache()


# -- report ---------------------------------------------------------------------------------


def print_report(result: ModelResult, args: argparse.Namespace) -> None:
    print(f"\n== {result.name}: {result.architecture} ({result.folder})")
    counts = {v: sum(1 for x in result.verdicts if x.verdict == v)
              for v in ("equal", "near-tie", "MISMATCH")}  # fmt: skip
    print(
        f"tokens, {args.devices} float32 vs cpu:0 float32: {counts['equal']} equal, "
        f"{counts['near-tie']} near-tie, {counts['MISMATCH']} MISMATCH of {len(result.verdicts)}; "
        f"largest |logprob diff| while equal {result.max_logprob_diff:.2e} "
        f"(cpu {result.cpu_s:.1f} s, device {result.device_check_s:.1f} s)"
    )
    for v in result.verdicts:
        if v.verdict == "equal":
            print(f"  prompt {v.prompt:3}: equal")
        else:
            print(
                f"  prompt {v.prompt:3}: {v.verdict} at token {v.position} (cpu {v.cpu_token}, "
                f"device {v.device_token}): {v.detail}"
            )
    print(f"kernels, {args.dtype}, TP=1 shapes, family vs torch reference (median of {args.reps}):")
    header = (
        f"  {'kernel':38} {'phase':7} {'shape':22} {'family':9} {'ref ms':>9} "
        f"{'kernel ms':>9} {'speedup':>7} {'max |diff|':>10}"
    )
    print(header)
    print("  " + "-" * (len(header) - 2))
    for r in result.kernels:
        print(
            f"  {r.kernel:38} {r.phase:7} {r.shape:22} {r.family:9} {r.ref_ms:9.3f} "
            f"{r.kernel_ms:9.3f} {r.speedup:7.2f} {r.max_abs_diff:10.2e}"
        )
    print(
        f"throughput ({result.workload}): {result.output_tok_s:.1f} output tok/s, "
        f"{result.total_tok_s:.1f} total tok/s in {result.bench_s:.1f} s"
    )


def machine() -> dict[str, Any]:
    record: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "host": platform.node(),
    }
    try:
        import triton

        record["triton"] = triton.__version__
    except ImportError:
        record["triton"] = None
    if torch.cuda.is_available():
        record["gpu"] = torch.cuda.get_device_name(0)
    return record


# -- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    default = "cuda" if torch.cuda.is_available() else "standin"
    parser.add_argument(
        "--device", choices=["cuda", "npu", "standin", "cpu"], default=default,
        help="cpu: the CPU kernels against themselves, which checks this script and nothing more",
    )  # fmt: skip
    parser.add_argument(
        "--preset", choices=["bench", "tiny"], default=None,
        help="model sizes; default bench on a device, tiny on the stand-in and the CPU",
    )  # fmt: skip
    parser.add_argument(
        "--models-dir", type=Path, default=None,
        help="where the models are (written there if missing); default: "
        "~/.cache/tandem/device-check",
    )  # fmt: skip
    parser.add_argument("--models", default=",".join(MODEL_NAMES), help="dense,hybrid,moe")
    parser.add_argument(
        "--dtype", default=None, choices=["float32", "float16", "bfloat16"],
        help="kernel timing and throughput (the token check is float32); default bfloat16 on "
        "a device, float32 on the stand-in (the interpreter has no bfloat16 arithmetic)",
    )  # fmt: skip
    parser.add_argument("--tie-margin", type=float, default=0.01, help="nats; see the rule above")
    parser.add_argument("--check-prompts", type=int, default=None)
    parser.add_argument("--check-tokens", type=int, default=None)
    parser.add_argument("--decode-batch", type=int, default=None)
    parser.add_argument("--context", type=int, default=None)
    parser.add_argument("--prefill-seqs", type=int, default=None)
    parser.add_argument("--prefill-len", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--bench-prompts", type=int, default=None)
    parser.add_argument("--bench-concurrency", type=int, default=None)
    parser.add_argument("--bench-in", type=int, default=None)
    parser.add_argument("--bench-out", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="folder for device_check.json")
    return parser.parse_args(argv)


# The size options, by their Sizes field names.
SIZE_OPTIONS = tuple(Sizes.__dataclass_fields__)


def sizes_from(args: argparse.Namespace) -> Sizes:
    sizes = DEVICE_SIZES if args.preset == "bench" else STANDIN_SIZES
    given = {name: getattr(args, name, None) for name in SIZE_OPTIONS}
    return replace(sizes, **{name: value for name, value in given.items() if value is not None})


def prepare(args: argparse.Namespace) -> None:
    """Settle the device: the stand-in installed, the hardware runtime registered (no install
    of tandem-hw needed, whose entry points would name it), float32 kept float32 on CUDA."""
    from tandem.device import register_runtime

    args.standin = args.device == "standin"
    args.kind = "npu" if args.standin else args.device
    args.devices = STANDIN_DEVICES if args.standin else f"{args.kind}:0"
    accelerator = args.kind != "cpu" and not args.standin
    # The stand-in's interpreter has no bfloat16 arithmetic, and CPUs without AMX or
    # AVX512-BF16 run bfloat16 matmuls a hundred times slower than float32.
    args.dtype = args.dtype or ("bfloat16" if accelerator else "float32")
    args.preset = args.preset or ("bench" if accelerator else "tiny")
    if args.standin:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit(
                "error: --device standin runs the Triton kernels under the interpreter: "
                "set TRITON_INTERPRET=1 before Python starts"
            )
        from tandem_sim.as_npu import RealTorchNpu, install
        from tandem_sim.standin_library import StandinUnavailable

        try:
            install()
        except (RealTorchNpu, StandinUnavailable) as exc:
            raise SystemExit(f"error: {exc}") from None
    elif args.kind == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("error: --device cuda, but torch sees no GPU; try --device standin")
        from tandem_hw.cuda_runtime import CudaRuntime

        register_runtime("cuda", CudaRuntime)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    elif args.kind == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu)
        from tandem_hw.npu_runtime import NpuRuntime

        register_runtime("npu", NpuRuntime)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Before Triton first compiles: float32 tl.dot at IEEE precision unless a kernel says.
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    args = parse_args(argv)
    prepare(args)
    sizes = sizes_from(args)
    args.reps = sizes.reps
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = sorted(set(names) - set(MODEL_NAMES))
    if unknown:
        raise SystemExit(f"error: unknown models {unknown}; choose from {', '.join(MODEL_NAMES)}")
    root = args.models_dir or Path.home() / ".cache" / "tandem" / "device-check"
    start = time.perf_counter()
    print(
        f"device check: {args.device} ({args.devices}), {args.preset} models, kernels and "
        f"throughput in {args.dtype}, tie margin {args.tie_margin} nats; {machine()}"
    )
    results = []
    for name in names:
        folder = write_model(name, args.preset, root / f"{name}-{args.preset}")
        result = check_model(name, folder, args, sizes)
        print_report(result, args)
        results.append(result)
    mismatches = sum(1 for r in results for v in r.verdicts if v.verdict == "MISMATCH")
    elapsed = time.perf_counter() - start
    print(
        f"\n{'FAILED' if mismatches else 'passed'}: {mismatches} token MISMATCH(es) over "
        f"{len(results)} models in {elapsed:.0f} s"
    )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        record = {
            "device": args.device,
            "devices": args.devices,
            "dtype": args.dtype,
            "tie_margin": args.tie_margin,
            "sizes": asdict(sizes),
            "machine": machine(),
            "seconds": elapsed,
            "models": [asdict(r) for r in results],
        }
        (args.out / "device_check.json").write_text(json.dumps(record, indent=2))
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
