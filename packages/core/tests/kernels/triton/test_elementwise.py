"""The Triton gated activations, rotary and fused q/k RMSNorm + rotary against their torch
references (``reference/elementwise.py``), under Triton's interpreter.

Error analysis, with the step-by-step bounds of ``cpu/rounding.py`` (two values that differ
by at most d round to values within d plus one ulp of each other):
- Rotary: the kernel rounds each product and the sum or difference where torch does, and the
  float32 product of two float16 values is exact, so in float32 and float16 the results are
  equal bit for bit. In bfloat16 the kernel widens first (no bfloat16 arithmetic) and only
  its conversions differ: Triton's interpreter converts float32 to bfloat16 by truncation,
  which moves a value by less than one ulp against half an ulp to nearest, so each rounding
  costs 1.5 ulps instead of one (``ulps=1.5``).
- q/k RMSNorm + rotary: the norm's float32 sum of squares runs in another order (the seed of
  ``rms_norm_bound``), propagated through the weight, the products and the sum, one ulp per
  rounding (1.5 in bfloat16). Without the weights it is rotary alone: equal in float32 and
  float16. The zero-centred norm (``zero_centered_norm_bound``) rounds once, after its two
  float32 products; partial rotary's pass-through dims carry the norm's bound alone.
- Gated activations: both sides take the activation in float32 from the same stored gate,
  each within 4 u32 (|act| + |gate|) of the exact value (exp, erf: an ulp or two each, the
  sum and quotient one rounding each; the |gate| term covers the absolute error of torch's
  ``1 + erf`` and ``1 + tanh``, which cancel for a negative gate), so 8 u32 (|act| + |gate|)
  apart; then the activation is rounded to the dtype and its product with ``up`` (exact in
  float32) rounded again. In float32 every bound is also under 1e-4 of max(1, |ref|).
These bounds allow an ulp or two, so they would not see a rounding moved to another place;
in float16 that shows as many unequal elements, where two implementations that round alike
differ only where a float32 difference of a few u32 straddles a float16 rounding boundary
(a few per thousand; ``mostly_identical`` allows 2 %). For the activations that holds where
the gate is above -1: below it torch's ``1 + erf``/``1 + tanh`` cancel and its result is off
by up to u32 |gate|, several float16 ulps of a small value.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from tandem.core.kernels.reference import elementwise as reference
from tandem.core.kernels.triton import activation, rotary

from ..cpu.rounding import (
    check_qk_norm_rotary_in_place,
    mostly_identical,
    rotary_bound,
    rounded,
    unit_roundoff,
    within,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def truncation_ulps(dtype: torch.dtype) -> float:
    """Ulps per rounding against torch's: 1.5 where the interpreter truncates to bfloat16."""
    return 1.5 if dtype is torch.bfloat16 else 1.0


def checked(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    within(got, want, bound)
    if want.dtype is torch.float32:
        error = (got.double() - want.double()).abs()
        assert bool((error <= 1e-4 * want.double().abs().clamp_min(1.0)).all())


TORCH_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh"),
}


# The tails overflow exp (to the infinity the formulas expect); numpy warns about it.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("name", sorted(activation.GATED_ACTIVATIONS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_activation_matches_the_reference(name: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(len(name))
    # Intermediate size 80: one tile, masked; a row of both tails, where exp over- and
    # underflows and 1 + erf, 1 + tanh cancel.
    gate_up = (torch.randn(7, 3, 160, generator=gen) * 3).to(dtype)
    tails = torch.tensor([-200.0, -30.0, -9.0, -5.0, 5.0, 9.0, 30.0, 200.0])
    gate_up[0, 0, :8] = tails.to(dtype)
    want = reference.GATED_ACTIVATIONS[name](gate_up)
    got = activation.GATED_ACTIVATIONS[name](gate_up)
    assert got.shape == want.shape == (7, 3, 80)
    gate, up = gate_up.double().chunk(2, dim=-1)
    exact = TORCH_ACTIVATIONS[name](gate)
    seed = 8 * unit_roundoff(torch.float32) * (exact.abs() + gate.abs())
    ulps = truncation_ulps(dtype)
    d_act = rounded(seed, exact, dtype, ulps)
    # The activation the reference stores (torch's op in the dtype), times up exactly.
    ref_act = TORCH_ACTIVATIONS[name](gate_up.chunk(2, dim=-1)[0])
    bound = rounded(up.abs() * d_act, ref_act.double() * up, dtype, ulps)
    checked(got, want, bound)
    if dtype is torch.float16:
        # Away from the cancelling tail the two float32 activations agree to a few u32:
        # the float16 results are then mostly equal, unless a rounding moved.
        kept = gate >= -1
        mostly_identical(got[kept], want[kept])


@pytest.mark.parametrize("dim", [64, 96])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_the_reference(dtype: torch.dtype, dim: int) -> None:
    gen = torch.Generator().manual_seed(dim)
    x = torch.randn(9, 5, dim, generator=gen).to(dtype)
    angles = torch.rand(9, 1, dim // 2, generator=gen) * 6.3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    want = reference.rotary(x, cos, sin)
    got = rotary.rotary(x, cos, sin)
    if dtype is torch.bfloat16:
        checked(got, want, rotary_bound(x, None, cos, sin, want, dim, dtype, 1.5))
    else:
        assert torch.equal(got, want)


def test_rotary_of_the_first_dims_of_wider_heads_leaves_the_input() -> None:
    """Partial rotary hands a strided view (the first 32 of 64 dims); the result is new."""
    heads = torch.randn(4, 3, 64, dtype=torch.float16)
    before = heads.clone()
    angles = torch.rand(4, 1, 16) * 6.3
    cos, sin = angles.cos().half(), angles.sin().half()
    view = heads[..., :32]
    assert torch.equal(rotary.rotary(view, cos, sin), reference.rotary(view, cos, sin))
    assert torch.equal(heads, before)
    # Tables in float32 with float16 heads: torch promotes, and so does the kernel.
    wide = (angles.cos(), angles.sin())
    assert torch.equal(rotary.rotary(view, *wide), reference.rotary(view, *wide))


@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("dim", [64, 96])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rotary_in_place_on_a_fused_projection(
    dtype: torch.dtype, dim: int, with_norm: bool
) -> None:
    kernel = rotary.qk_norm_rotary
    ulps = truncation_ulps(dtype)
    heads, seed = (6, 4, 2), dim + with_norm
    pairs = check_qk_norm_rotary_in_place(kernel, dtype, dim, with_norm, heads, seed, ulps)
    for got, want in pairs:
        if not with_norm and dtype is not torch.bfloat16:
            assert torch.equal(got, want)
        elif dtype is torch.float16:
            mostly_identical(got, want)


@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize(("dim", "rotary_dim"), [(128, 32), (96, 32), (64, 64)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_centered_norm_and_partial_rotary_inside_the_gated_projection(
    dtype: torch.dtype, dim: int, rotary_dim: int, with_norm: bool
) -> None:
    """Qwen3.5's gated attention: zero-centred norm, partial rotary, q strided between the
    output gates. The pass-through dims are a third, non-power-of-two tile at (96, 32)."""
    ulps = truncation_ulps(dtype)
    pairs = check_qk_norm_rotary_in_place(
        rotary.qk_norm_rotary, dtype, dim, with_norm, (6, 4, 2), dim + rotary_dim, ulps,
        zero_centered=True, rotary_dim=rotary_dim,
    )  # fmt: skip
    for got, want in pairs:
        if not with_norm and dtype is not torch.bfloat16:
            assert torch.equal(got, want)
        elif dtype is torch.float16:
            mostly_identical(got, want)


def test_qk_norm_rotary_with_weights_of_another_dtype_promotes_as_torch() -> None:
    """float32 norm weights on float16 heads: torch's results are float32, so the
    reference serves them (the kernel writes q and k in their own dtype)."""
    q, k = torch.randn(3, 2, 64).half(), torch.randn(3, 1, 64).half()
    weight = torch.rand(64) + 0.5
    angles = torch.outer(torch.arange(8).float(), torch.rand(32))
    tables = angles.cos().half(), angles.sin().half()
    positions = torch.tensor([0, 7, 3])
    args = (weight, weight, 1e-6, *tables, positions)
    got = rotary.qk_norm_rotary(q, k, *args)
    want = reference.qk_norm_rotary(q, k, *args)
    assert all(
        g.dtype is torch.float32 and torch.equal(g, w) for g, w in zip(got, want, strict=True)
    )
