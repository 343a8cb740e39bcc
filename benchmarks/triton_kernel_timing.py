"""Time the Triton kernels the first H200 device check found slower than their torch
references, at that check's shapes, and print one table.

    PYTHONPATH=packages/device:packages/collectives:packages/core:hw \\
        python benchmarks/triton_kernel_timing.py --device cuda

The kernels: ``paged_prefill`` at head size 64 (16 query and 8 KV heads; 8 and 2) and 128 (8
and 2) over 8 fresh prompts of 256 tokens, ``gated_silu`` on [48, 5632], [2048, 5632] and
[2048, 5120] projections, and ``chunk_gated_delta_rule`` over the same 8 x 256 prompts with 4
key heads and 8 value heads of 64, each in bfloat16 (``--dtype``) against the torch reference
the engine would otherwise run. Two times per side, in milliseconds:

- ``gpu``: ``triton.testing.do_bench``'s median, calls queued back to back behind its L2
  flush, so the host's launch path hides behind the device: the kernel's own time.
- ``call``: one call on an idle device between two events after a synchronize, median of
  ``--reps``, as ``device_check.py`` measures: the host's launch path plus the kernel. A
  kernel of a few microseconds is all launch path here.

``max |diff|`` is the largest difference of the outputs; ``ok`` says it is within two ulps of
the output dtype at the reference's largest magnitude (any kernel here may differ from its
reference by the order of float32 sums and a rounding of the output).

``--device cpu`` runs tiny shapes under Triton's interpreter (it sets ``TRITON_INTERPRET=1``
before Triton is imported) with wall-clock times in both columns: a check that the script
runs, not a measurement. Needs only torch and triton.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from device_check import prefill_input

Fn = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class Shapes:
    prefill_seqs: int
    prefill_len: int
    activation_rows: tuple[tuple[int, int], ...]  # (tokens, 2 * intermediate)


CUDA_SHAPES = Shapes(8, 256, ((48, 5632), (2048, 5632), (2048, 5120)))
CPU_SHAPES = Shapes(2, 24, ((3, 256), (16, 320)))
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Case:
    kernel: str
    shape: str
    reference: Fn
    triton: Fn


@dataclass(frozen=True)
class Row:
    case: Case
    ref_gpu: float
    triton_gpu: float
    ref_call: float
    triton_call: float
    max_diff: float
    ok: bool


def prefill_cases(shapes: Shapes, dtype: torch.dtype, device: torch.device) -> list[Case]:
    from tandem.core.kernels.reference.paged_attention import reference_prefill
    from tandem.core.kernels.triton.paged_prefill import paged_prefill
    from tandem.core.llm.attention_metadata import build_attention_metadata

    fi = prefill_input(shapes.prefill_seqs, shapes.prefill_len, vocab=1, base_block=1, seed=0)
    group = build_attention_metadata(fi, device).prefill
    assert group is not None
    num_blocks = int(fi.block_tables.max()) + 1
    cases = []
    for heads, kv_heads, head_dim in ((16, 8, 64), (8, 2, 64), (8, 2, 128)):
        gen = torch.Generator().manual_seed(head_dim + heads)
        cache_shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
        k_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
        v_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
        q = torch.randn(group.num_tokens, heads, head_dim, generator=gen).to(device, dtype)
        scale = head_dim**-0.5
        ref_out, out = torch.empty_like(q), torch.empty_like(q)

        def ref(q: torch.Tensor = q, kc: torch.Tensor = k_cache, vc: torch.Tensor = v_cache,
                out: torch.Tensor = ref_out, scale: float = scale) -> torch.Tensor:  # fmt: skip
            return reference_prefill(q, q, q, kc, vc, group, scale, out)

        def tri(q: torch.Tensor = q, kc: torch.Tensor = k_cache, vc: torch.Tensor = v_cache,
                out: torch.Tensor = out, scale: float = scale) -> torch.Tensor:  # fmt: skip
            return paged_prefill(q, q, q, kc, vc, group, scale, out)

        shape = f"{group.num_tokens}x{heads}x{head_dim} kv{kv_heads}"
        cases.append(Case(f"paged_prefill[head_dim={head_dim}]", shape, ref, tri))
    return cases


def activation_cases(shapes: Shapes, dtype: torch.dtype, device: torch.device) -> list[Case]:
    from tandem.core.kernels.reference.elementwise import GATED_ACTIVATIONS
    from tandem.core.kernels.triton.activation import gated_silu

    reference = GATED_ACTIVATIONS["silu"]
    cases = []
    for rows, width in shapes.activation_rows:
        gen = torch.Generator().manual_seed(rows + width)
        x = torch.randn(rows, width, generator=gen).to(device, dtype)
        cases.append(
            Case(
                "gated_silu",
                f"{rows}x{width}",
                functools.partial(reference, x),
                functools.partial(gated_silu, x),
            )
        )
    return cases


def delta_rule_case(shapes: Shapes, dtype: torch.dtype, device: torch.device) -> Case:
    """The hybrid bench model's Gated DeltaNet layer: 4 key heads, 8 value heads, 64 wide."""
    from tandem.core.kernels.reference import gated_delta_rule as reference
    from tandem.core.kernels.triton import gated_delta_rule as kernel
    from tandem.core.llm.attention_metadata import build_attention_metadata

    fi = prefill_input(shapes.prefill_seqs, shapes.prefill_len, vocab=1, base_block=1, seed=1)
    meta = build_attention_metadata(fi, device, conv_kernel_size=4).linear
    assert meta is not None
    n, hk, hv, dk, dv = fi.positions.shape[0], 4, 8, 64, 64
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(n, hk, dk, generator=gen).to(device, dtype)
    k = torch.randn(n, hk, dk, generator=gen).to(device, dtype)
    v = torch.randn(n, hv, dv, generator=gen).to(device, dtype)
    # A layer's log decay is negative (float32) and its beta a sigmoid.
    g = (-torch.rand(n, hv, generator=gen) * 0.5).to(device)
    beta = torch.rand(n, hv, generator=gen).to(device, dtype)
    states = torch.zeros(shapes.prefill_seqs + 1, hv, dk, dv, device=device)
    # Fresh prompts start from zeros whatever their slot holds, so repeated calls on one pool
    # all compute the same thing.
    return Case(
        "chunk_gated_delta_rule",
        f"{n}x{hk}x{dk} v{hv}x{dv}",
        lambda: reference.chunk_gated_delta_rule(q, k, v, g, beta, states, meta),
        lambda: kernel.chunk_gated_delta_rule(q, k, v, g, beta, states, meta),
    )


class Timer:
    def __init__(self, device: torch.device, reps: int) -> None:
        self.cuda = device.type == "cuda"
        self.reps = reps

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def call(self, fn: Fn) -> float:
        """One call on an idle device, as device_check.py times it."""
        self.sync()
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        cuda: Any = torch.cuda  # its Event is untyped
        begin = cuda.Event(enable_timing=True)
        end = cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        return float(begin.elapsed_time(end))

    def calls(self, fns: tuple[Fn, Fn]) -> tuple[float, float]:
        figures: tuple[list[float], list[float]] = ([], [])
        for _ in range(self.reps):
            # Taking turns, so that load from elsewhere falls on both alike.
            for fn, into in zip(fns, figures, strict=True):
                into.append(self.call(fn))
        return statistics.median(figures[0]), statistics.median(figures[1])

    def gpu(self, fn: Fn) -> float:
        if not self.cuda:
            return self.call(fn)
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def measure(case: Case, timer: Timer) -> Row:
    with torch.inference_mode():
        want, got = case.reference(), case.triton()
        timer.sync()
        dtype = got.dtype
        want, got = want.float(), got.float()
        diff = float((got - want).abs().max()) if want.numel() else 0.0
        top = float(want.abs().max()) if want.numel() else 0.0
        # Two ulps of the output dtype at the reference's largest magnitude.
        ulp = torch.finfo(dtype).eps * 2.0 ** torch.tensor(max(top, 1e-30)).log2().floor().item()
        ref_call, triton_call = timer.calls((case.reference, case.triton))
        return Row(
            case,
            ref_gpu=timer.gpu(case.reference),
            triton_gpu=timer.gpu(case.triton),
            ref_call=ref_call,
            triton_call=triton_call,
            max_diff=diff,
            ok=diff <= 2 * ulp,
        )


def print_table(rows: list[Row], failures: list[tuple[str, str, str]]) -> None:
    head = (
        f"{'kernel':28} {'shape':22} {'ref gpu':>8} {'tri gpu':>8} {'x':>6} "
        f"{'ref call':>8} {'tri call':>8} {'x':>6} {'max |diff|':>10}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        gpu_x = r.ref_gpu / r.triton_gpu if r.triton_gpu > 0 else float("nan")
        call_x = r.ref_call / r.triton_call if r.triton_call > 0 else float("nan")
        print(
            f"{r.case.kernel:28} {r.case.shape:22} {r.ref_gpu:8.3f} {r.triton_gpu:8.3f} "
            f"{gpu_x:6.2f} {r.ref_call:8.3f} {r.triton_call:8.3f} {call_x:6.2f} "
            f"{r.max_diff:10.2e} {'ok' if r.ok else 'TOO FAR'}"
        )
    for kernel, shape, error in failures:
        print(f"{kernel:28} {shape:22} FAILED: {error}")
    print("times in ms; x = reference / triton (above 1: Triton faster)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--reps", type=int, default=20, help="single calls per side (call)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--device cpu needs TRITON_INTERPRET=1 before triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu for the interpreter check")
    import triton

    device = torch.device(args.device)
    dtype: torch.dtype = getattr(torch, args.dtype)
    shapes = CUDA_SHAPES if args.device == "cuda" else CPU_SHAPES
    name = torch.cuda.get_device_name(device) if args.device == "cuda" else "interpreter"
    print(f"{name}: torch {torch.__version__}, triton {triton.__version__}, {args.dtype}")
    started = time.perf_counter()
    builders: list[tuple[str, Callable[[], list[Case]]]] = [
        ("paged_prefill", lambda: prefill_cases(shapes, dtype, device)),
        ("gated_silu", lambda: activation_cases(shapes, dtype, device)),
        ("chunk_gated_delta_rule", lambda: [delta_rule_case(shapes, dtype, device)]),
    ]
    timer = Timer(device, args.reps if args.device == "cuda" else 2)
    rows: list[Row] = []
    failures: list[tuple[str, str, str]] = []
    # One kernel's failure (a compile error, say) must not hide the others' rows.
    for kernel, build in builders:
        try:
            cases = build()
        except Exception as error:  # noqa: BLE001
            failures.append((kernel, "", f"{type(error).__name__}: {error}"))
            continue
        for case in cases:
            try:
                rows.append(measure(case, timer))
            except Exception as error:  # noqa: BLE001
                failures.append((case.kernel, case.shape, f"{type(error).__name__}: {error}"))
    print_table(rows, failures)
    print(f"{time.perf_counter() - started:.1f} s")
    return 1 if failures or not all(r.ok for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
