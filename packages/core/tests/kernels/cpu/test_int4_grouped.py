"""The CPU 4-bit experts' grouped linear (``NativeInt4Linear.grouped_linear``,
``csrc/int4_grouped.h``): rows ``offsets[e]`` to ``offsets[e + 1]`` times expert e's weight,
every expert in one call, at every ISA level this CPU runs (AVX-512, AVX2, the plain loops).

Bound, per element, against float64 products of the dequantized weights. The kernel forms
each weight exactly as the reference does (``test_int4_linear.py`` checks that bit for bit;
here ``dequantize_int4`` in the activations' dtype gives those weights, exact in float64),
and bfloat16 activations widen to float32 exactly, so the only errors are the float32 sum
and the output's rounding. A float32 sum of K products in any order, FMA or not (zero
padding adds exact zeros), is within gamma_K S of the exact value, S = sum_k |x_k w_k|,
gamma_K = K u / (1 - K u), u = 2^-24 (Higham, Accuracy and Stability, sec. 3.1). The
AVX512-BF16 dot path may flush denormal inputs, products and sums to zero: each flush loses
less than 2^-126, at most sum_k |x_k| + sum_k |w_k| from the inputs and 2 K from products
and sums (``test_int4_linear.py``'s docstring has the count), so E = 2^-126 (sum |x| + sum |w|
+ 2 K) more. A bfloat16 output is that float32 value rounded to nearest once, within u_b = 2^-8
of it: |got - exact| <= (gamma_K S + E) + u_b (|exact| + gamma_K S + E). A weight a whole
quantization step off, or an expert's rows through another expert's weight, moves outputs by
far more (the mutations the report lists failed these checks).

Each expert's rows also equal, bit for bit, the dense kernel's own call on those rows where
the dense call runs the kernel (up to ``kernel_rows``): the grouped call runs the same tiles
and panels, chosen by the expert's row count as the dense call chooses by its batch.
"""

from __future__ import annotations

import pytest
import torch

from tandem.core.kernels import handles
from tandem.core.kernels.cpu.int4_linear import (
    NativeInt4Linear,
    load_native_int4_linear,
    native_int4_linear,
)
from tandem.core.kernels.cpu.native_build import ISA_LEVELS, expected_path, isa_levels
from tandem.core.kernels.reference import quantized_moe as qmoe_ref
from tandem.core.kernels.reference.int4_linear import dequantize_int4
from tandem.core.kernels.reference.int4_packing import pack_int4

U32 = 2.0**-24
U_BF16 = 2.0**-8
TINY = 2.0**-126
DTYPES = [torch.float32, torch.bfloat16]
LEVELS = [level.name for level in isa_levels()]
Experts = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _kernel(level: str) -> NativeInt4Linear:
    kernel = load_native_int4_linear(isa=ISA_LEVELS[level])
    if kernel is None:
        pytest.skip("no C++ compiler to build the 4-bit kernel")
    assert kernel.compiled_path == expected_path(ISA_LEVELS[level])
    assert kernel.grouped
    return kernel


def _experts(experts: int, n: int, k: int, group: int, dtype: torch.dtype, seed: int) -> Experts:
    """Stacked packed codes [E, n, k / 8], scales [E, n, G] in ``dtype``, zeros uint8."""
    gen = torch.Generator().manual_seed(seed)
    groups = k // group
    q = torch.randint(0, 16, (experts, n, k), generator=gen)
    codes = torch.stack([pack_int4(q[e], dim=1) for e in range(experts)])
    zeros = torch.randint(1, 17, (experts, n, groups), generator=gen).to(torch.uint8)
    scales = (torch.rand(experts, n, groups, generator=gen) * 0.05 + 1e-3).to(dtype)
    return codes, scales, zeros


def _offsets(rows_per_expert: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(rows_per_expert).cumsum(0).tolist()])


def _check_against_float64(
    got: torch.Tensor, x: torch.Tensor, experts: Experts, offsets: torch.Tensor
) -> None:
    codes, scales, zeros = experts
    k = x.shape[1]
    gamma = k * U32 / (1 - k * U32)
    for e in range(codes.shape[0]):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        w = dequantize_int4(codes[e], scales[e], zeros[e], None, x.dtype).double()
        xe = x[lo:hi].double()
        exact = xe @ w.t()
        s = xe.abs() @ w.abs().t()
        flushes = TINY * (xe.abs().sum(-1, keepdim=True) + w.abs().sum(-1) + 2 * k)
        bound = gamma * s + flushes
        if got.dtype is torch.bfloat16:
            bound = bound + U_BF16 * (exact.abs() + bound)
        diff = (got[lo:hi].double() - exact).abs()
        assert bool((diff <= bound).all()), (e, float((diff - bound).max()))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES)
# K a whole number of vector blocks or not (200: a partial AVX2 and AVX-512 block), groups of
# one word, of a quarter 128-input block, of one block; N not a whole panel of any path.
@pytest.mark.parametrize(("n", "k", "group"), [(72, 200, 8), (40, 256, 32), (100, 256, 128)])
# Empty experts among active ones (first, between, last); rows that take the weights straight
# from the codes (1-4) and rows that buffer them (5, 13, 40: past the dense call's 32 float32
# rows).
@pytest.mark.parametrize(
    "rows_per_expert", [[0, 1, 0, 3, 2, 0], [4, 0, 13, 1, 5, 0], [40, 0, 0, 1, 0, 7]]
)
def test_one_call_multiplies_each_experts_rows_by_its_weight(
    level: str, dtype: torch.dtype, n: int, k: int, group: int, rows_per_expert: list[int]
) -> None:
    kernel = _kernel(level)
    experts = _experts(len(rows_per_expert), n, k, group, dtype, seed=n + k)
    offsets = _offsets(rows_per_expert)
    gen = torch.Generator().manual_seed(sum(rows_per_expert))
    x = torch.randn(int(offsets[-1]), k, generator=gen).to(dtype)
    got = kernel.grouped_linear(x, offsets, *experts)
    assert got.dtype is dtype and got.shape == (x.shape[0], n)
    _check_against_float64(got, x, experts, offsets)
    codes, scales, zeros = experts
    for e, count in enumerate(rows_per_expert):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        if 0 < count <= kernel.kernel_rows[dtype]:
            dense = kernel.int4_linear(x[lo:hi], codes[e], scales[e], zeros[e], None, None)
            assert torch.equal(got[lo:hi], dense), e


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_more_than_512_rows_for_one_expert(level: str, dtype: torch.dtype) -> None:
    """A prefill's share for one expert (600 rows) beside a decode-sized one and an empty
    one: every row through the kernel (forced: so many rows an expert go expert by expert
    by default, also checked), none left out or sent to another expert."""
    kernel = _kernel(level)
    rows_per_expert = [600, 0, 3]
    experts = _experts(3, 48, 256, 128, dtype, seed=11)
    offsets = _offsets(rows_per_expert)
    x = torch.randn(603, 256, generator=torch.Generator().manual_seed(11)).to(dtype)
    per_expert = kernel.grouped_linear(x, offsets, *experts)
    _check_against_float64(per_expert, x, experts, offsets)
    kernel.kernel_rows[dtype] = 603
    got = kernel.grouped_linear(x, offsets, *experts)
    _check_against_float64(got, x, experts, offsets)
    # The kernel's rows of the small expert are the dense kernel's, bit for bit.
    codes, scales, zeros = experts
    dense = kernel.int4_linear(x[600:], codes[2], scales[2], zeros[2], None, None)
    assert torch.equal(got[600:], dense)


@pytest.mark.parametrize("level", LEVELS)
def test_no_rows_at_all(level: str) -> None:
    kernel = _kernel(level)
    experts = _experts(4, 16, 64, 32, torch.float32, seed=2)
    got = kernel.grouped_linear(torch.empty(0, 64), torch.zeros(5, dtype=torch.int64), *experts)
    assert got.shape == (0, 16)


@pytest.mark.parametrize("level", LEVELS)
def test_offsets_it_cannot_trust_are_refused(level: str) -> None:
    """Offsets are read by the kernel where they lie: ones out of order, negative, past the
    rows or not covering them (rows left unwritten) are refused before any row is read."""
    kernel = _kernel(level)
    experts = _experts(2, 16, 64, 32, torch.float32, seed=3)
    x = torch.randn(5, 64)
    assert kernel.grouped_linear(x, torch.tensor([0, 2, 5]), *experts).shape == (5, 16)
    for bad in ([0, 2, 4], [0, 2, 6], [1, 2, 5], [0, 3, 2], [-1, 2, 5], [0, 6, 5]):
        with pytest.raises(ValueError, match="refused its arguments"):
            kernel.grouped_linear(x, torch.tensor(bad), *experts)
    for bad_tensor in (torch.tensor([0, 5]), torch.tensor([0, 2, 5], dtype=torch.int32)):
        with pytest.raises(ValueError, match="expert offsets"):
            kernel.grouped_linear(x, bad_tensor, *experts)


def test_groups_the_kernel_does_not_read_and_the_reference_stay_within_the_bound() -> None:
    """Groups of 4 inputs (half a packed word: the kernel reads whole words a group) take
    the per-expert path, the offsets read on the host; the reference handle (other devices)
    computes the same products."""
    kernel = _kernel(LEVELS[0])
    rows_per_expert = [2, 0, 5]
    offsets = _offsets(rows_per_expert)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(5))
    for group, linear in ((4, kernel.grouped_linear), (32, qmoe_ref.moe_int4_grouped_linear)):
        experts = _experts(3, 24, 64, group, torch.float32, seed=group)
        _check_against_float64(linear(x, offsets, *experts), x, experts, offsets)


def test_the_cpu_handle_picks_the_grouped_call() -> None:
    handle = handles.moe_int4_grouped_linear()
    chosen = handle.choose(["cpu"], torch.float32)
    kernel = native_int4_linear()
    if kernel is None:
        assert chosen is qmoe_ref.moe_int4_grouped_linear
        return
    assert getattr(chosen, "__func__", None) is NativeInt4Linear.grouped_linear
    assert handle.choose(["cpu"], torch.float16) is qmoe_ref.moe_int4_grouped_linear
