"""torch_npu's quantized matmuls as the W8A8 and W4A16 kernels (``kernels/npu/int8_linear.py``,
``int4_linear.py``), through the stand-in, against the torch references, and the load-time
layouts they read (``kernels/npu/layouts.py``).

The int8 codes and int32 sums are exact, so they must equal the reference's. The outputs scale
the same exact sums by the same two float32 factors, in the op's documented order rather than
the reference's, so they may differ by a float32 rounding before the one to the model's dtype:
within one unit in the last place of that dtype. The 4-bit weight is formed exactly as the
reference forms it; the product is summed in float32 in another order: within two roundings
at the output's scale."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from tandem.core.kernels import handles
from tandem.core.kernels.npu import int4_linear as npu_int4
from tandem.core.kernels.npu import int8_linear as npu_int8
from tandem.core.kernels.npu.layouts import (
    PER_CHANNEL,
    int4_unsupported,
    int8_scale_layout,
    npu_int4_layout,
)
from tandem.core.kernels.reference import int4_linear as int4_ref
from tandem.core.kernels.reference import int8_linear as int8_ref
from tandem.core.kernels.reference.int4_packing import pack_int4

HALVES = [torch.float16, torch.bfloat16]
FAMILIES = ("torch_npu", "triton")
M, K, N = 7, 128, 48


def within_ulps(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, ulps: float) -> None:
    err = (got.float() - want.float()).abs()
    bound = ulps * torch.finfo(dtype).eps * want.float().abs().max()
    assert (err <= bound).all(), f"worst {(err / bound).max().item():.2f} of the bound"


def int8_layer(gen: torch.Generator, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    weight = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=gen)
    scale = (torch.rand(N, 1, generator=gen) * 0.01 + 1e-3).to(dtype)
    return weight, scale


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("static", [False, True])
def test_int8_linear_matches_the_reference(
    standin_torch_npu: ModuleType, dtype: torch.dtype, static: bool
) -> None:
    gen = torch.Generator().manual_seed(3 + static)
    weight, scale = int8_layer(gen, dtype)
    x = torch.randn(2, M, K, generator=gen).to(dtype)
    x[1, 3] = 0  # a row of zeros quantizes to zeros either way
    bias = torch.randn(N, generator=gen).to(dtype)
    input_scale = torch.tensor(0.02, dtype=dtype) if static else None
    got = npu_int8.int8_linear(x, weight, int8_scale_layout(scale), input_scale, bias)
    want = int8_ref.int8_linear(x, weight, scale, input_scale, bias)
    assert got.shape == want.shape and got.dtype is dtype
    within_ulps(got, want, dtype, 1)


@pytest.mark.parametrize("dtype", HALVES)
def test_int8_quantize_and_matmul_equal_the_reference(
    standin_torch_npu: ModuleType, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(5)
    weight, _ = int8_layer(gen, dtype)
    x = torch.randn(M, K, generator=gen).to(dtype)
    # One rank's columns, scaled by every rank's absmax (row-parallel layers).
    absmax = x.float().abs().amax(-1, keepdim=True) * 1.5
    for scale, mx in ((None, None), (None, absmax), (torch.tensor(0.03, dtype=dtype), None)):
        q, s = npu_int8.int8_quantize(x, scale, mx)
        want_q, want_s = int8_ref.quantize_int8(x, scale, mx)
        assert torch.equal(q, want_q)
        assert torch.equal(s, want_s)
    got = npu_int8.int8_matmul(want_q, weight)
    assert got.dtype is torch.int32
    assert torch.equal(got, int8_ref.int8_matmul(want_q, weight))


def int4_layer(
    gen: torch.Generator, dtype: torch.dtype, groups: int, sym: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    codes = pack_int4(torch.randint(0, 16, (N, K), generator=gen), dim=1)
    scales = (torch.rand(N, groups, generator=gen) * 0.05 + 0.01).to(dtype)
    zeros = torch.full((N, groups), 8, dtype=torch.uint8)
    if not sym:
        zeros = torch.randint(1, 16, (N, groups), generator=gen).to(torch.uint8)
    return codes, scales, zeros


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize(("groups", "sym"), [(4, True), (2, False), (1, False)])
def test_int4_linear_matches_the_reference(
    standin_torch_npu: ModuleType, dtype: torch.dtype, groups: int, sym: bool
) -> None:
    gen = torch.Generator().manual_seed(groups + 7 * sym)
    codes, scales, zeros = int4_layer(gen, dtype, groups, sym)
    assert int4_unsupported(codes, scales) is None
    layout = npu_int4_layout(codes, scales, zeros, dtype)
    assert layout.group_size == (PER_CHANNEL if groups == 1 else K // groups)
    assert (layout.offset is None) == sym
    assert layout.packed.shape == (K, N // 8)
    x = torch.randn(3, M, K, generator=gen).to(dtype)
    bias = torch.randn(N, generator=gen).to(dtype)
    got = npu_int4.int4_linear(x, layout, scales, zeros, None, bias)
    want = int4_ref.int4_linear(x, codes, scales, zeros, None, bias)
    assert got.shape == want.shape and got.dtype is dtype
    within_ulps(got, want, dtype, 2)


def test_int4_linear_in_the_cpu_layout_runs_the_reference(standin_torch_npu: ModuleType) -> None:
    gen = torch.Generator().manual_seed(11)
    codes, scales, zeros = int4_layer(gen, torch.bfloat16, 4, False)
    g_idx = torch.randperm(K, generator=gen) % 4
    x = torch.randn(M, K, generator=gen).bfloat16()
    got = npu_int4.int4_linear(x, codes, scales, zeros, g_idx, None)
    assert torch.equal(got, int4_ref.int4_linear(x, codes, scales, zeros, g_idx, None))


def test_groups_the_op_cannot_take_are_named() -> None:
    codes = torch.zeros(N, K // 8, dtype=torch.int32)
    assert "not a multiple of 32" in str(int4_unsupported(codes, torch.ones(N, K // 16)))
    assert int4_unsupported(codes, torch.ones(N, K // 32)) is None
    wide = torch.zeros(8, 65536 // 8, dtype=torch.int32)
    assert "exceed" in str(int4_unsupported(wide, torch.ones(8, 1)))


def test_handles_resolve_the_npu_kernels_for_the_dtypes_the_ops_take(
    standin_torch_npu: ModuleType,
) -> None:
    for dtype in HALVES:
        assert handles.int8_linear().choose(FAMILIES, dtype) is npu_int8.int8_linear
        assert handles.int8_quantize().choose(FAMILIES, dtype) is npu_int8.int8_quantize
        assert handles.int4_linear().choose(FAMILIES, dtype) is npu_int4.int4_linear
    # npu_dynamic_quant takes half precision only; the int8 product takes any codes.
    assert handles.int8_linear().choose(FAMILIES, torch.float32) is int8_ref.int8_linear
    assert handles.int4_linear().choose(FAMILIES, torch.float32) is int4_ref.int4_linear
    assert handles.int8_matmul().choose(FAMILIES, torch.int8) is npu_int8.int8_matmul
    assert handles.int8_dequantize().choose(FAMILIES, torch.int32) is int8_ref.dequantize
