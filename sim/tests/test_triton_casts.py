"""The interpreter's float32 -> bfloat16 cast, once the stand-in has set it, rounds as compiled
Triton and torch do: to nearest, ties to even."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tandem_sim.triton_casts import float32_bits_to_bfloat16, round_like_compiled_triton

pytest.importorskip("triton")
import triton
import triton.language as tl


def _edge_floats() -> torch.Tensor:
    """Random floats across the range, and the bit patterns where rounding decides: exact
    ties with an even and an odd kept bit, just below and above a tie, a carry into the
    exponent, the largest finite values (overflowing to infinity), subnormals, zeros, inf."""
    torch.manual_seed(0)
    spread = torch.randn(4096) * torch.exp2(torch.randint(-140, 120, (4096,)).float())
    kept = torch.randint(0, 1 << 16, (512,), dtype=torch.int64) << 16
    low = torch.tensor([0x8000, 0x7FFF, 0x8001, 0xFFFF, 0x0001, 0x0000])
    patterns = (kept[:, None] | low[None, :]).flatten()
    patterns = torch.cat([patterns, torch.tensor([0x3F7FFFFF, 0x7F7FFFFF, 0x7F7F8000, 0x00008000])])
    bits = patterns.to(torch.int32)  # wraps the sign bit as the float's bits
    return torch.cat([spread, bits.view(torch.float32), -bits.view(torch.float32)])


def test_the_bit_rounding_equals_torchs() -> None:
    x = _edge_floats()
    finite = ~torch.isnan(x)
    ours = float32_bits_to_bfloat16(x.numpy().view(np.uint32))
    theirs = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours[finite.numpy()], theirs[finite.numpy()])
    nan = torch.from_numpy(ours[~finite.numpy()].view(np.int16)).view(torch.bfloat16)
    assert bool(torch.isnan(nan).all())


@triton.jit  # type: ignore[untyped-decorator]
def _cast(x_ptr, out_ptr, n, RTZ: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    y = x.to(tl.bfloat16, fp_downcast_rounding="rtz") if RTZ else x.to(tl.bfloat16)
    tl.store(out_ptr + offs, y, mask=mask)


def _run(x: torch.Tensor, rtz: bool) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    block = 1024
    _cast[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), RTZ=rtz, BLOCK=block)
    return out


def test_a_kernels_cast_rounds_to_nearest_even_under_the_stand_in() -> None:
    round_like_compiled_triton()
    round_like_compiled_triton()  # once per process, however often the stand-in starts
    x = _edge_floats()
    finite = ~torch.isnan(x)
    out = _run(x, rtz=False)
    expected = x.to(torch.bfloat16)
    assert torch.equal(out[finite].view(torch.int16), expected[finite].view(torch.int16))
    assert bool(torch.isnan(out[~finite]).all())
    # An explicit round-toward-zero is the kernel's choice, and stays the interpreter's (which
    # mangles subnormals there: not ours to mend).
    normal = x[finite & (x.abs() >= torch.finfo(torch.float32).tiny)]
    towards_zero = _run(normal, rtz=True)
    truncated = (normal.view(torch.int32) >> 16).to(torch.int16)
    assert torch.equal(towards_zero.view(torch.int16), truncated)
