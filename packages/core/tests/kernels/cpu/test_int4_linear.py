"""The CPU 4-bit linear (``kernels/cpu/int4_linear.py``) against the reference, at every ISA
level this CPU runs (AVX-512, AVX2, the plain loops), so an AVX-512 run covers the code an
AVX2 user's machine runs.

Contract. Both sides form each weight the same way: (q - z) is a small exact integer, times
the scale rounded once in float32, and once more to bfloat16 for bfloat16 activations; so the
weights are equal bit for bit (checked exactly: a one-hot activation row reads one weight
back, a sum with a single nonzero term). Only the sums differ. With S = sum_k |x_k w_k| + |b|,
a float32 sum of K products and a bias, in any order, FMA or not, is within
gamma_{K+1} S of the exact value, gamma_j = j u / (1 - j u), u = 2^-24 (Higham, Accuracy and
Stability, sec. 3.1); both the kernel and the reference are, so they differ by at most
2 gamma_{K+1} S. A bfloat16 output is that float32 sum rounded once (half an ulp, 2^-9
relative) on each side: |kernel - reference| <= 2 gamma_{K+1} S + 2^-8 (|ref| + 2 gamma_{K+1}
S). A nibble out of place or a zero point off by one moves a weight by a whole step, far
outside that (checked below).
"""

from __future__ import annotations

import pytest
import torch

from tandem.core.kernels import handles
from tandem.core.kernels.cpu.int4_linear import (
    DECODE_ROWS,
    NativeInt4Linear,
    load_native_int4_linear,
)
from tandem.core.kernels.cpu.native_build import ISA_LEVELS, expected_path, isa_levels
from tandem.core.kernels.reference.int4_linear import dequantize_int4, int4_linear
from tandem.core.kernels.reference.int4_packing import pack_int4

U32 = 2.0**-24
DTYPES = [torch.float32, torch.bfloat16]
LEVELS = [level.name for level in isa_levels()]
Layer = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _kernel(level: str) -> NativeInt4Linear:
    kernel = load_native_int4_linear(isa=ISA_LEVELS[level])
    if kernel is None:
        pytest.skip("no C++ compiler to build the 4-bit kernel")
    assert kernel.compiled_path == expected_path(ISA_LEVELS[level])
    return kernel


def _layer(n: int, k: int, group: int, dtype: torch.dtype, seed: int) -> Layer:
    """(q [n, k], packed codes, scales [n, G] in ``dtype``, zeros uint8 [n, G])."""
    gen = torch.Generator().manual_seed(seed)
    groups = k // group
    q = torch.randint(0, 16, (n, k), generator=gen)
    zeros = torch.randint(1, 17, (n, groups), generator=gen).to(torch.uint8)
    scales = (torch.rand(n, groups, generator=gen) * 0.05 + 1e-3).to(dtype)
    return q, pack_int4(q, dim=1), scales, zeros


def _bound(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, ref: torch.Tensor
) -> torch.Tensor:
    k = x.shape[-1]
    gamma = (k + 1) * U32 / (1 - (k + 1) * U32)
    s = x.double().abs().reshape(-1, k) @ w.double().abs().t()
    if bias is not None:
        s = s + bias.double().abs()
    bound = 2 * gamma * s
    if ref.dtype is torch.bfloat16:
        bound = bound + 2.0**-8 * (ref.double().reshape(bound.shape).abs() + bound)
    return bound


def _within(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> bool:
    diff = (got.double() - ref.double()).reshape(bound.shape).abs()
    return bool((diff <= bound).all())


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES)
# K a whole number of vector blocks or not (200: a partial AVX2 and AVX-512 block), groups of
# one word (8) up to one per channel; rows across the 8-row (4 on AVX2) blocks, and past
# DECODE_ROWS (the dequantize-then-GEMM path).
@pytest.mark.parametrize(
    ("n", "k", "group"), [(64, 64, 32), (48, 200, 8), (40, 1024, 128), (18, 256, 256)]
)
@pytest.mark.parametrize("rows", [1, 3, 8, 13, DECODE_ROWS, DECODE_ROWS + 9])
def test_products_match_the_reference_within_the_bound(
    level: str, dtype: torch.dtype, n: int, k: int, group: int, rows: int
) -> None:
    kernel = _kernel(level)
    _, codes, scales, zeros = _layer(n, k, group, dtype, seed=rows + k)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    for b in (None, bias):
        want = int4_linear(x, codes, scales, zeros, None, b)
        got = kernel.int4_linear(x, codes, scales, zeros, None, b)
        assert got.dtype is dtype and got.shape == (rows, n)
        w = dequantize_int4(codes, scales, zeros, None, dtype)
        assert _within(got, want, _bound(x, w, b, want))
        if rows > DECODE_ROWS:
            # The same weights through the same GEMM: the reference's result exactly.
            assert torch.equal(got, want)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES)
# A group per word (vector lanes of several groups), and a group per 128-input block (the
# table lookup, straight into the FMAs for batches up to 4 rows, buffered above).
@pytest.mark.parametrize(("n", "k", "group"), [(24, 200, 8), (20, 256, 128)])
@pytest.mark.parametrize("batch", [1, 4, DECODE_ROWS, DECODE_ROWS + 1])
def test_each_weight_is_the_reference_weight_bit_for_bit(
    level: str, dtype: torch.dtype, n: int, k: int, group: int, batch: int
) -> None:
    """One-hot rows read the weights back (a single nonzero term is summed exactly),
    ``batch`` rows a call (above DECODE_ROWS: the dequantized weight through torch's GEMM)."""
    kernel = _kernel(level)
    _, codes, scales, zeros = _layer(n, k, group, dtype, seed=9)
    eye = torch.eye(k, dtype=dtype)
    got = torch.cat(
        [
            kernel.int4_linear(eye[i : i + batch], codes, scales, zeros, None, None)
            for i in range(0, k, batch)
        ]
    )
    assert torch.equal(got.t(), dequantize_int4(codes, scales, zeros, None, dtype))


@pytest.mark.parametrize("level", LEVELS)
def test_strided_and_batched_activations(level: str) -> None:
    """x of [B, T, K] and a column slice of a wider tensor (rows not contiguous)."""
    kernel = _kernel(level)
    n, k = 32, 128
    _, codes, scales, zeros = _layer(n, k, 32, torch.float32, seed=3)
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(6, 2 * k, generator=gen)
    for x in (wide[:, 8 : 8 + k], wide[:, :k].reshape(2, 3, k)):
        got = kernel.int4_linear(x, codes, scales, zeros, None, None)
        want = int4_linear(x, codes, scales, zeros, None, None)
        assert got.shape == want.shape
        w = dequantize_int4(codes, scales, zeros, None, torch.float32)
        assert _within(got, want, _bound(x, w, None, want))


def test_scales_in_another_dtype_are_rounded_as_the_reference_rounds_them() -> None:
    """float16 scales (as checkpoints store them) under bfloat16 activations."""
    kernel = _kernel(LEVELS[0])
    _, codes, scales, zeros = _layer(32, 128, 64, torch.float16, seed=4)
    x = torch.randn(2, 128).to(torch.bfloat16)
    eye = torch.eye(128, dtype=torch.bfloat16)[:DECODE_ROWS]
    got = kernel.int4_linear(eye, codes, scales, zeros, None, None)
    want = dequantize_int4(codes, scales, zeros, None, torch.bfloat16)[:, :DECODE_ROWS]
    assert torch.equal(got.t(), want)
    assert kernel.int4_linear(x, codes, scales, zeros, None, None).dtype is torch.bfloat16


def test_activation_order_and_other_dtypes_run_the_reference() -> None:
    kernel = _kernel(LEVELS[0])
    n, k = 16, 64
    _, codes, scales, zeros = _layer(n, k, 16, torch.float32, seed=5)
    gen = torch.Generator().manual_seed(5)
    g_idx = (torch.arange(k) // 16)[torch.randperm(k, generator=gen)]
    x = torch.randn(3, k, generator=gen)
    want = int4_linear(x, codes, scales, zeros, g_idx, None)
    assert torch.equal(kernel.int4_linear(x, codes, scales, zeros, g_idx, None), want)
    half = x.to(torch.float16)
    got = kernel.int4_linear(half, codes, scales.half(), zeros, None, None)
    assert torch.equal(got, int4_linear(half, codes, scales.half(), zeros, None, None))


@pytest.mark.parametrize("defect", ["nibble order", "zero point off by one"])
def test_the_bound_catches_a_one_step_defect(defect: str) -> None:
    kernel = _kernel(LEVELS[0])
    n, k = 32, 128
    q, codes, scales, zeros = _layer(n, k, 32, torch.float32, seed=6)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(6))
    want = int4_linear(x, codes, scales, zeros, None, None)
    if defect == "nibble order":
        codes = pack_int4(q.view(n, -1, 8).flip(-1).reshape(n, k), dim=1)
    else:
        zeros = zeros + 1
    got = kernel.int4_linear(x, codes, scales, zeros, None, None)
    w = dequantize_int4(codes, scales, zeros, None, torch.float32)
    assert not _within(got, want, _bound(x, w, None, want))


def test_the_cpu_handle_picks_the_kernel() -> None:
    chosen = handles.int4_linear().choose(["cpu"], torch.float32)
    kernel = load_native_int4_linear()
    if kernel is None:
        assert chosen is int4_linear
        return
    assert getattr(chosen, "__func__", None) is NativeInt4Linear.int4_linear
    assert handles.int4_linear().choose(["cpu"], torch.float16) is int4_linear
