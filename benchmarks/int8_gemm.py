"""The CPU int8 (W8A8) kernel against the torch reference (``torch._int_mm``) and against the
float32 and bfloat16 linears Tandem serves, on the bench model's projection shapes.

Each side is a real layer as the loader leaves it: ``QuantizableLinear`` with its int8 weight
packed at load (ours) or left plain (the reference, what ``TANDEM_INT8=torch`` serves, same
handles), ``PackableLinear`` packed into oneDNN's layout (float32, bfloat16; our AVX-512/AMX
kernels read it where the CPU has them). A decode step streams every weight from memory,
so each side cycles through copies of its weight that together exceed the CPU's caches
(--pool MiB), and GB/s counts the weight bytes one call reads. The sides run interleaved
(A B A B ...), each figure the median of --rounds; 'int32 product' times the int8 matmul step
alone (ours against torch._int_mm on the same codes).

``--paths`` instead times this kernel's code paths against each other, the fused linear on
each one's own packed copies: the native build (AVX512-VNNI where the CPU has it), the
``TANDEM_CPU_ISA=avx2`` build, and the AVX-VNNI path's test build (its ymm ``vpdpbusd`` in the
EVEX encoding; needs AVX512-VNNI + AVX512-VL or AVX-VNNI).

    python benchmarks/int8_gemm.py [--rows 1 8 32 256] [--rounds 5] [--pool 256] [--threads N]
        [--paths]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from compare import cpu_line
from torch import nn

from tandem.core.kernels.cpu.int8_gemm import (
    YMM_VNNI_TEST_DEFINE,
    NativeInt8,
    PackedInt8Weight,
    load_native_int8,
    native_int8,
)
from tandem.core.kernels.cpu.native_build import ISA_LEVELS, NATIVE_ISA
from tandem.core.kernels.cpu.packed_linear import PackableLinear, pack_linear_weights
from tandem.core.kernels.reference import int8_linear as ref
from tandem.core.layers.int8_packing import pack_int8_weights
from tandem.core.layers.quant_scheme import W8A8Scheme
from tandem.core.layers.quantized_linear import QuantizableLinear

# [out_features, in_features] of the bench model (`tandem make-demo-model --preset bench`).
SHAPES = {
    "qkv_proj": (2048, 1024),
    "o_proj": (1024, 1024),
    "gate_up_proj": (5632, 1024),
    "down_proj": (1024, 2816),
}
CPU = torch.device("cpu")


@dataclass
class Side:
    """One kernel's copies of a weight, called in turn (one sweep: one call per copy)."""

    name: str
    bytes_per_call: int
    sweep: Callable[[torch.Tensor], None]
    calls: int


def _copies(bytes_each: int, pool_mib: int) -> int:
    return max(2, -(-pool_mib * 2**20 // bytes_each))


def _int8_layers(n: int, k: int, count: int, packed: bool) -> list[QuantizableLinear]:
    gen = torch.Generator().manual_seed(n + k)
    weight = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    scale = torch.rand(n, 1, generator=gen) * 0.01
    layers = nn.ModuleList()
    for _ in range(count):
        layer = QuantizableLinear()
        layer.make_weight(n, k, W8A8Scheme(static=False))
        layer.weight.data.copy_(weight)
        assert layer.weight_scale is not None
        layer.weight_scale.data.copy_(scale)
        layers.append(layer)
    if packed and pack_int8_weights(layers, CPU) != count:
        raise SystemExit("no CPU int8 kernel here (no compiler, or TANDEM_INT8=torch)")
    return [layer for layer in layers if isinstance(layer, QuantizableLinear)]


def _float_layers(n: int, k: int, count: int, dtype: torch.dtype) -> list[PackableLinear]:
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(n * k)) * 0.02
    layers = nn.ModuleList()
    for _ in range(count):
        layer = PackableLinear()
        layer.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
        layers.append(layer)
    pack_linear_weights(layers, CPU, dtype)
    return [layer for layer in layers if isinstance(layer, PackableLinear)]


def _calling(
    layers: list[QuantizableLinear] | list[PackableLinear],
) -> Callable[[torch.Tensor], None]:
    def sweep(x: torch.Tensor) -> None:
        for layer in layers:
            layer.matmul(x)

    return sweep


def _products(
    layers: list[QuantizableLinear], plain: list[QuantizableLinear]
) -> tuple[Callable[[torch.Tensor], None], Callable[[torch.Tensor], None]]:
    kernels = native_int8()
    assert kernels is not None
    weights = [layer.int8_packed for layer in layers]

    def ours(q: torch.Tensor) -> None:
        for weight in weights:
            assert isinstance(weight, PackedInt8Weight)
            kernels.matmul(q, weight)

    def theirs(q: torch.Tensor) -> None:
        for layer in plain:
            ref.int8_matmul(q, layer.weight)

    return ours, theirs


def _interleaved(sides: list[Side], x: dict[str, torch.Tensor], rounds: int) -> dict[str, float]:
    """Median ms per call of each side, the sides alternating sweep by sweep."""
    times: dict[str, list[float]] = {side.name: [] for side in sides}
    for side in sides:
        side.sweep(x[side.name])  # warm: first-call dispatch, page faults
    for _ in range(rounds):
        for side in sides:
            start = time.perf_counter()
            side.sweep(x[side.name])
            times[side.name].append(1000 * (time.perf_counter() - start) / side.calls)
    return {name: statistics.median(values) for name, values in times.items()}


def _row(label: str, rows: int, ms: dict[str, float], sides: list[Side]) -> str:
    cells = [f"{rows:>4} {label:<13}"]
    for side in sides:
        gbps = side.bytes_per_call / ms[side.name] / 1e6
        cells.append(f"{ms[side.name]:>8.3f} {gbps:>6.1f}")
    return " | ".join(cells)


def _path_builds() -> dict[str, NativeInt8]:
    """The kernel's builds ``--paths`` compares, by the code path each reports."""
    builds = (
        load_native_int8(None, NATIVE_ISA),
        load_native_int8(None, NATIVE_ISA, amx=False),
        load_native_int8(None, ISA_LEVELS["avx2"]),
        load_native_int8(None, NATIVE_ISA, (YMM_VNNI_TEST_DEFINE,)),
    )
    return {kernels.compiled_path: kernels for kernels in builds if kernels is not None}


def _path_side(kernels: NativeInt8, n: int, k: int, pool_mib: int) -> Side:
    """Copies of one [n, k] weight packed for ``kernels``, each called with its fused linear."""
    gen = torch.Generator().manual_seed(n + k)
    weight = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    scale = torch.rand(n, 1, generator=gen) * 0.01
    count = _copies(n * k, pool_mib)
    weights = [kernels.pack(weight.clone()) for _ in range(count)]

    def sweep(x: torch.Tensor) -> None:
        for packed in weights:
            kernels.linear(x, packed, scale, None, None)

    return Side(kernels.compiled_path, n * k, sweep, count)


def compare_paths(rows: list[int], rounds: int, pool_mib: int) -> int:
    builds = _path_builds()
    print(cpu_line())
    print(f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}; ", end="")
    print(f"{torch.get_num_threads()} threads; paths: {', '.join(builds)}")
    print(f"fused linear, ms per call and GB/s of weight bytes read, median of {rounds} rounds")
    for label, (n, k) in SHAPES.items():
        sides = [_path_side(kernels, n, k, pool_mib) for kernels in builds.values()]
        print(f"\n{label} [{n}, {k}]")
        print(f"{'':<18} | " + " | ".join(f"{s.name:^15}" for s in sides))
        print(f"{'rows':>4} {'':<13} | " + " | ".join(f"{'ms':>8} {'GB/s':>6}" for _ in sides))
        for m in rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            inputs = {side.name: x for side in sides}
            print(_row("linear", m, _interleaved(sides, inputs, rounds), sides))
    print(f"\nload average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pool", type=int, default=256, help="MiB of weight copies per side")
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--paths", action="store_true", help="this kernel's code paths instead")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.paths:
        return compare_paths(args.rows, args.rounds, args.pool)
    kernels = native_int8()
    if kernels is None:
        print("no CPU int8 kernel here (no compiler, or TANDEM_INT8=torch): nothing to compare")
        return 1
    print(cpu_line())
    print(f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}; ", end="")
    print(f"{torch.get_num_threads()} threads; ours: {kernels.name}; torch {torch.__version__}")
    print(f"ms per call and GB/s of weight bytes read, median of {args.rounds} interleaved rounds")
    for label, (n, k) in SHAPES.items():
        count8 = _copies(n * k, args.pool)
        packed = _int8_layers(n, k, count8, packed=True)
        plain = _int8_layers(n, k, count8, packed=False)
        ours_mm, theirs_mm = _products(packed, plain)
        count32, count16 = _copies(4 * n * k, args.pool), _copies(2 * n * k, args.pool)
        linears = [
            Side("int8 ours", n * k, _calling(packed), count8),
            Side("int8 torch", n * k, _calling(plain), count8),
            Side(
                "float32", 4 * n * k, _calling(_float_layers(n, k, count32, torch.float32)), count32
            ),
            Side(
                "bfloat16",
                2 * n * k,
                _calling(_float_layers(n, k, count16, torch.bfloat16)),
                count16,
            ),
        ]
        products = [
            Side("int32 ours", n * k, ours_mm, count8),
            Side("int32 _int_mm", n * k, theirs_mm, count8),
        ]
        print(f"\n{label} [{n}, {k}]")
        print(f"{'':<18} | " + " | ".join(f"{s.name:^15}" for s in linears))
        print(f"{'rows':>4} {'':<13} | " + " | ".join(f"{'ms':>8} {'GB/s':>6}" for _ in linears))
        for rows in args.rows:
            print(f"  {label} at {rows} rows ...", file=sys.stderr, flush=True)
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            inputs = {
                "int8 ours": x, "int8 torch": x, "float32": x, "bfloat16": x.bfloat16(),
            }  # fmt: skip
            print(_row("linear", rows, _interleaved(linears, inputs, args.rounds), linears))
            q, _ = ref.quantize_int8(x, None)
            codes = {"int32 ours": q, "int32 _int_mm": q}
            print(_row("int32 product", rows, _interleaved(products, codes, args.rounds), products))
    print(f"\nload average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
