"""The 4-bit packing and the reference W4A16 linear against float64 arithmetic.

Error bound. With codes q, zero points z and scales s fixed, the exact result is
y[m, n] = sum_k x[m, k] (q[n, k] - z[n, g(k)]) s[n, g(k)] + b[n]. The kernel forms each weight
with one float32 rounding (q - z is a small exact integer), so within u = 2^-24 of its exact
value, then sums K products in float32 and adds the bias: the classic bound for a float dot
product gives |kernel - exact| <= (K + 2) u (sum_k |x_k w_k| + |b|) (the weight's own rounding
is one u of that sum, K for the sum, one for the bias). The float64 side is exact to ~K 2^-53,
far below it. A wrong nibble order or a zero point off by one moves a weight by a whole step
and breaks the bound by orders of magnitude (checked below).
"""

from __future__ import annotations

import pytest
import torch

from tandem.core.kernels import handles
from tandem.core.kernels.reference.int4_linear import int4_linear
from tandem.core.kernels.reference.int4_packing import AWQ_ORDER, pack_int4, unpack_int4

U32 = 2.0**-24


def _bit_by_bit_unpack(words: torch.Tensor) -> torch.Tensor:
    """[R, C] int32 -> [R, 8 C], written the slow way: input 8c + i from bits 4i..4i+3."""
    rows, cols = words.shape
    out = torch.zeros(rows, 8 * cols, dtype=torch.int64)
    for c in range(cols):
        for i in range(8):
            out[:, 8 * c + i] = (words[:, c].long() >> (4 * i)) & 0xF
    return out


def test_pack_puts_the_first_code_in_the_lowest_nibble() -> None:
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15]])
    (word,) = pack_int4(codes, dim=1).flatten().tolist()
    assert word & 0xFFFFFFFF == 0xF7654321
    assert word < 0  # stored as int32, so the top nibble 15 sets the sign bit


def test_awq_order_interleaves_the_run() -> None:
    """AutoAWQ's ``order_map`` [0, 2, 4, 6, 1, 3, 5, 7]: nibble i holds code order_map[i]."""
    codes = torch.arange(8).reshape(1, 8)
    (word,) = pack_int4(codes, dim=1, order=AWQ_ORDER).flatten().tolist()
    assert word == 0x75316420
    packed = pack_int4(torch.randint(0, 16, (4, 16)), dim=1, order=AWQ_ORDER)
    assert torch.equal(
        pack_int4(unpack_int4(packed, dim=1, order=AWQ_ORDER), dim=1, order=AWQ_ORDER), packed
    )


@pytest.mark.parametrize("dim", [0, 1])
def test_unpack_inverts_pack_along_either_dim(dim: int) -> None:
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (24, 16), generator=gen)
    packed = pack_int4(codes, dim=dim)
    assert packed.dtype is torch.int32
    assert packed.shape == ((3, 16) if dim == 0 else (24, 2))
    assert torch.equal(unpack_int4(packed, dim=dim).long(), codes)
    along_rows = packed if dim == 1 else packed.t()
    expected = codes if dim == 1 else codes.t()
    assert torch.equal(_bit_by_bit_unpack(along_rows), expected)


def test_pack_refuses_what_does_not_fit() -> None:
    with pytest.raises(ValueError, match="whole int32 words"):
        pack_int4(torch.zeros(2, 12, dtype=torch.int64), dim=1)
    with pytest.raises(ValueError, match=r"0\.\.15"):
        pack_int4(torch.full((1, 8), 16), dim=1)


def _layer(
    n: int, k: int, groups: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randint(0, 16, (n, k), generator=gen)
    zeros = torch.randint(1, 17, (n, groups), generator=gen)
    scales = torch.rand(n, groups, generator=gen) * 0.05 + 1e-3
    return q, zeros, scales


def _exact(
    x: torch.Tensor,
    q: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 result, its error bound for the float32 kernel)."""
    w = (q.double() - zeros.double()[:, g_idx]) * scales.double()[:, g_idx]
    y = x.double() @ w.t()
    magnitude = x.double().abs() @ w.abs().t()
    if bias is not None:
        y, magnitude = y + bias.double(), magnitude + bias.double().abs()
    return y, (x.shape[-1] + 2) * U32 * magnitude


@pytest.mark.parametrize("group", [32, 64, -1])
@pytest.mark.parametrize("with_bias", [False, True])
def test_consecutive_groups_stay_within_the_float32_bound(group: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    n, k = 48, 128
    groups = 1 if group == -1 else k // group
    q, zeros, scales = _layer(n, k, groups, gen)
    x = torch.randn(5, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    codes = pack_int4(q, dim=1)
    got = handles.int4_linear()(x, codes, scales, zeros.to(torch.uint8), None, bias)
    g_idx = torch.arange(k) // (k // groups)
    exact, bound = _exact(x, q, zeros, scales, g_idx, bias)
    assert got.dtype is torch.float32 and got.shape == (5, n)
    assert ((got.double() - exact).abs() <= bound).all()


def test_activation_order_groups_follow_g_idx() -> None:
    gen = torch.Generator().manual_seed(3)
    n, k, group = 16, 64, 16
    q, zeros, scales = _layer(n, k, k // group, gen)
    g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=gen)]
    x = torch.randn(3, 2, k, generator=gen)
    got = int4_linear(x, pack_int4(q, dim=1), scales, zeros.to(torch.uint8), g_idx, None)
    exact, bound = _exact(x.reshape(-1, k), q, zeros, scales, g_idx, None)
    assert got.shape == (3, 2, n)
    assert ((got.reshape(-1, n).double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("defect", ["nibble order", "zero point off by one"])
def test_the_bound_catches_a_one_step_defect(defect: str) -> None:
    gen = torch.Generator().manual_seed(4)
    n, k = 32, 128
    q, zeros, scales = _layer(n, k, 4, gen)
    x = torch.randn(4, k, generator=gen)
    codes, z = pack_int4(q, dim=1), zeros
    if defect == "nibble order":
        codes = pack_int4(q.view(n, -1, 8).flip(-1).reshape(n, k), dim=1)
    else:
        z = zeros + 1
    got = int4_linear(x, codes, scales, z.to(torch.uint8), None, None)
    exact, bound = _exact(x, q, zeros, scales, torch.arange(k) // 32, None)
    assert ((got.double() - exact).abs() > bound).any()
