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
2 gamma_{K+1} S. A bfloat16 output is that float32 sum rounded once on each side, to
nearest: half an ulp, within u_b = 2^-8 of the rounded value (8-bit significands; an earlier
version of this bound took 2^-9 and so counted one side's rounding only, which held while
the kernel's float32 sums fell on the reference's side of every rounding midpoint, and
failed once the dot path summed in another order: 41 rows, a sum 1e-7 from a midpoint,
rounded one ulp apart). So |kernel - reference| <= 2 gamma_{K+1} S + 2 u_b (|ref| + 2
gamma_{K+1} S). A nibble out of place or a zero point off by one moves a weight by a whole step, far
outside that (checked below).

bfloat16 activations on AVX512-BF16 CPUs take VDPBF16PS dot products on bfloat16 weights
(the same bfloat16 weights, so the exact-weight check holds as it is). Intel's description
(SDM vol. 2, VDPBF16PS): each lane adds two products of bfloat16 pairs to a float32
accumulator, rounding to nearest-even whatever MXCSR says, with denormal inputs read as
zero and denormal results written as zero (DAZ and FTZ), raising no exceptions. A product
of two bfloat16 (8-bit significands) is exact in float32 unless it falls below float32's
normal range, and every addition rounds once, within u; the lanes are then summed by a
tree and the bias added, all in float32: another order of the same float32 sum, so
gamma_{K+1} S still bounds it (zero padding adds exact zeros). Outside that model are the
flushes: a denormal activation or weight drops its term, below 2^-126 |w_k| or
2^-126 |x_k|, and each flushed product or partial sum (at most two a product: its own and
the sum's) loses less than 2^-126. So each side gets E = 2^-126 (sum_k |x_k| + sum_k |w_k|
+ 2 K) more, whichever side flushes (the reference's GEMM may take the same instruction):
2 gamma_{K+1} S + 2 E, then the bfloat16 rounding as above. E is some 1e-34 here, the
bound as tight as before: the defect checks run on that path too.
"""

from __future__ import annotations

import pytest
import torch

from tandem.core.kernels import handles
from tandem.core.kernels.cpu import startup
from tandem.core.kernels.cpu.int4_linear import (
    BF16_DOT_ROWS,
    DECODE_ROWS,
    NativeInt4Linear,
    load_native_int4_linear,
)
from tandem.core.kernels.cpu.native_build import ISA_LEVELS, expected_path, isa_levels
from tandem.core.kernels.reference.int4_linear import dequantize_int4, int4_linear
from tandem.core.kernels.reference.int4_packing import pack_int4

U32 = 2.0**-24
# The smallest normal float32: what a flush to zero loses at most.
TINY = 2.0**-126
DTYPES = [torch.float32, torch.bfloat16]
LEVELS = [level.name for level in isa_levels()]
Layer = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _kernel(level: str) -> NativeInt4Linear:
    kernel = load_native_int4_linear(isa=ISA_LEVELS[level])
    if kernel is None:
        pytest.skip("no C++ compiler to build the 4-bit kernel")
    assert kernel.compiled_path == expected_path(ISA_LEVELS[level])
    # The dot-product path is built wherever the level lets the compiler use AVX512-BF16.
    assert kernel.bf16_dot == ("avx512_bf16" in ISA_LEVELS[level].cpu_flags())
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
    # The flushes to zero (module docstring), on either side.
    flushes = x.double().abs().reshape(-1, k).sum(-1, keepdim=True) + w.double().abs().sum(-1)
    bound = 2 * gamma * s + 2 * TINY * (flushes + 2 * k)
    if ref.dtype is torch.bfloat16:
        # Both sides round once, each within 2^-8 of its result (module docstring).
        bound = bound + 2 * 2.0**-8 * (ref.double().reshape(bound.shape).abs() + bound)
    return bound


def _within(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> bool:
    diff = (got.double() - ref.double()).reshape(bound.shape).abs()
    return bool((diff <= bound).all())


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES)
# K a whole number of vector blocks or not (200: a partial AVX2 and AVX-512 block), groups of
# one word (8) up to one per channel (several groups a 128-input dot block, a group a block,
# a group of two blocks); rows across the 4-row blocks (2 on AVX2), the bfloat16 dot
# path's unbuffered batches (up to 3 rows) and buffered ones, and past DECODE_ROWS and
# BF16_DOT_ROWS (where the dequantize-then-GEMM path takes over).
@pytest.mark.parametrize(
    ("n", "k", "group"), [(64, 64, 32), (48, 200, 8), (40, 1024, 128), (18, 256, 256)]
)
@pytest.mark.parametrize(
    "rows", [1, 3, 4, 5, 8, 13, DECODE_ROWS, DECODE_ROWS + 9, BF16_DOT_ROWS, BF16_DOT_ROWS + 1]
)
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
        if rows > kernel.kernel_rows[dtype]:
            # The same weights through the same GEMM: the reference's result exactly.
            assert torch.equal(got, want)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES)
# A group per word (vector lanes of several groups), and a group per 128-input block (the
# table lookup, straight into the FMAs for batches up to 4 rows, buffered above).
@pytest.mark.parametrize(("n", "k", "group"), [(24, 200, 8), (20, 256, 128)])
@pytest.mark.parametrize("batch", [1, 3, 4, DECODE_ROWS, DECODE_ROWS + 1, BF16_DOT_ROWS + 1])
def test_each_weight_is_the_reference_weight_bit_for_bit(
    level: str, dtype: torch.dtype, n: int, k: int, group: int, batch: int
) -> None:
    """One-hot rows read the weights back (a single nonzero term is summed exactly),
    ``batch`` rows a call (above the kernel's rows: the dequantized weight through torch's
    GEMM)."""
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
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("group", "rows"), [(32, 6), (128, 6), (128, 2)])
def test_strided_and_batched_activations(
    level: str, dtype: torch.dtype, group: int, rows: int
) -> None:
    """x of [B, T, K] and a column slice of a wider tensor (rows not contiguous)."""
    kernel = _kernel(level)
    n, k = 32, 256
    _, codes, scales, zeros = _layer(n, k, group, dtype, seed=3)
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(rows, 2 * k, generator=gen).to(dtype)
    for x in (wide[:, 8 : 8 + k], wide[:, :k].reshape(2, rows // 2, k)):
        got = kernel.int4_linear(x, codes, scales, zeros, None, None)
        want = int4_linear(x, codes, scales, zeros, None, None)
        assert got.shape == want.shape
        w = dequantize_int4(codes, scales, zeros, None, dtype)
        assert _within(got, want, _bound(x, w, None, want))


# The bfloat16 dot path forced past BF16_DOT_ROWS (the kernel is good for any batch; the
# threshold is only where torch's GEMM catches up), on every kind of layer.
@pytest.mark.parametrize(("n", "k", "group"), [(48, 200, 8), (40, 1024, 128), (18, 256, 256)])
@pytest.mark.parametrize("rows", [BF16_DOT_ROWS + 1, 2 * BF16_DOT_ROWS + 3])
def test_bf16_dot_products_forced_past_the_threshold(n: int, k: int, group: int, rows: int) -> None:
    kernel = _kernel(LEVELS[0])
    if not kernel.bf16_dot:
        pytest.skip("no AVX512-BF16 here: bfloat16 takes the float32 path")
    kernel.kernel_rows[torch.bfloat16] = rows
    _, codes, scales, zeros = _layer(n, k, group, torch.bfloat16, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    want = int4_linear(x, codes, scales, zeros, None, bias)
    got = kernel.int4_linear(x, codes, scales, zeros, None, bias)
    w = dequantize_int4(codes, scales, zeros, None, torch.bfloat16)
    assert _within(got, want, _bound(x, w, bias, want))


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
@pytest.mark.parametrize("dtype", DTYPES)
# Groups of a quarter block and of a block; 2 rows (the unbuffered dot path), 4 (buffered).
@pytest.mark.parametrize(("group", "rows"), [(32, 4), (128, 2), (128, 4)])
def test_the_bound_catches_a_one_step_defect(
    defect: str, dtype: torch.dtype, group: int, rows: int
) -> None:
    kernel = _kernel(LEVELS[0])
    n, k = 32, 256
    q, codes, scales, zeros = _layer(n, k, group, dtype, seed=6)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(6)).to(dtype)
    want = int4_linear(x, codes, scales, zeros, None, None)
    if defect == "nibble order":
        codes = pack_int4(q.view(n, -1, 8).flip(-1).reshape(n, k), dim=1)
    else:
        zeros = zeros + 1
    got = kernel.int4_linear(x, codes, scales, zeros, None, None)
    w = dequantize_int4(codes, scales, zeros, None, dtype)
    assert not _within(got, want, _bound(x, w, None, want))


def test_the_cpu_handle_picks_the_kernel() -> None:
    chosen = handles.int4_linear().choose(["cpu"], torch.float32)
    kernel = load_native_int4_linear()
    if kernel is None:
        assert chosen is int4_linear
        return
    assert getattr(chosen, "__func__", None) is NativeInt4Linear.int4_linear
    assert handles.int4_linear().choose(["cpu"], torch.float16) is int4_linear


@pytest.mark.parametrize("level", LEVELS)
def test_the_start_up_report_says_what_runs(level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``tandem doctor``'s int4 row names the bfloat16 dot path and its batch limit where
    it is built, the fused float32 path and the GEMM above it everywhere."""
    kernel = _kernel(level)
    monkeypatch.setattr(startup, "native_int4_linear", lambda: kernel)
    why = startup._int4_choice("no library").why
    assert f"fused up to {DECODE_ROWS} rows" in why and "torch's GEMM above" in why
    dot = f"AVX512-BF16 dot products on bfloat16 weight panels up to {BF16_DOT_ROWS} rows"
    assert (dot in why) == kernel.bf16_dot
