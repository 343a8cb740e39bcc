"""The reference int8 linear (W8A8) against float64 arithmetic.

With the activations' int8 codes q_x and scales s_x fixed, the exact result is
s_x[m] * s_w[n] * sum_k q_x[m, k] q_w[n, k]: float64 holds every product and sum of int8
codes exactly, so the float64 dequantize-then-matmul computes it exactly, up to its own two
scale multiplications (2 * 2^-53). The kernel's sum is exact in int32; it then rounds four
times in float32 (int32 -> float32, times s_x, times s_w, plus the bias), each within 2^-24
relative, so |kernel - exact| <= 4 * 2^-24 * (|exact| + |bias|): the tolerance below.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tandem.core.kernels import handles
from tandem.core.kernels.reference.int8_linear import (
    int8_linear,
    int8_matmul,
    quantize_int8,
)

EPS32 = 2.0**-24


def _codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token quantization as specified: scale = absmax / 127 in float32, codes
    rounded half to even."""
    scale = x.float().abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.round(x.float() / scale).clamp(-128, 127), scale


def _exact(
    q: torch.Tensor, s: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    out = (q.double() * s.double()) @ (w.double() * ws.double().reshape(-1, 1)).t()
    return out + bias.double() if bias is not None else out


def _weights(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    return w, torch.rand(n, 1, generator=gen) * 0.02 + 1e-3


def test_per_token_codes_bound_the_error_and_reach_127() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 100, generator=gen) * torch.logspace(-3, 3, 9).reshape(-1, 1)
    x[4] = 0.0
    q, scale = quantize_int8(x, None)
    assert q.dtype is torch.int8 and scale.shape == (9, 1)
    assert q.abs().max().item() == 127 and (q[4] == 0).all()
    # Half a step, plus the float32 division's rounding of x / scale (<= 127 * 2^-24 steps).
    error = (x.double() - q.double() * scale.double()).abs()
    assert (error <= scale.double() * (0.5 + 128 * EPS32)).all()
    assert (q.abs().amax(-1)[torch.arange(9) != 4] == 127).all()


def test_static_codes_saturate_at_the_int8_range() -> None:
    x = torch.tensor([[-10.0, -1.0, -0.25, 0.25, 0.75, 10.0]])
    q, _ = quantize_int8(x, torch.tensor([0.5]))
    assert q.tolist() == [[-20, -2, 0, 0, 2, 20]]  # half to even: 0.5 -> 0, 1.5 -> 2
    q, _ = quantize_int8(x * 100, torch.tensor(0.5))
    assert q.tolist() == [[-128, -128, -50, 50, 127, 127]]


def test_int32_accumulation_is_exact_at_the_extremes() -> None:
    k = 4096
    a = torch.full((3, k), -128, dtype=torch.int8)
    b = torch.full((5, k), -128, dtype=torch.int8)
    assert (int8_matmul(a, b) == 128 * 128 * k).all()
    gen = torch.Generator().manual_seed(1)
    a = torch.randint(-128, 128, (17, 300), dtype=torch.int8, generator=gen)
    b = torch.randint(-128, 128, (33, 300), dtype=torch.int8, generator=gen)
    got = int8_matmul(a, b)
    assert got.dtype is torch.int32
    assert torch.equal(got.long(), a.long() @ b.long().t())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_dynamic_linear_equals_float64_dequantize_then_matmul(bias: bool, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 256, generator=gen) * 3
    w, ws = _weights(48, 256, gen)
    b = torch.randn(48, generator=gen) if bias else None
    got = int8_linear(x, w, ws, None, b)
    q, s = _codes(x)
    exact = _exact(q, s, w, ws, b)
    bound = 4 * EPS32 * (exact.abs() + (b.double().abs() if b is not None else 0))
    assert got.dtype is torch.float32 and got.shape == (rows, 48)
    assert ((got.double() - exact).abs() <= bound + 1e-300).all()


def test_static_linear_equals_float64_dequantize_then_matmul() -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, 128, generator=gen)
    w, ws = _weights(32, 128, gen)
    scale = torch.tensor(0.01)  # small enough that the tails saturate
    got = int8_linear(x, w, ws, scale, None)
    q = torch.round(x / 0.01).clamp(-128, 127)
    exact = _exact(q, torch.full((6, 1), 0.01), w, ws, None)
    assert ((got.double() - exact).abs() <= 4 * EPS32 * exact.abs()).all()


def test_leading_dims_and_half_precision_inputs() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 64, generator=gen).to(torch.bfloat16)
    w, ws = _weights(16, 64, gen)
    got = int8_linear(x, w, ws.to(torch.bfloat16), None, None)
    assert got.shape == (2, 3, 16) and got.dtype is torch.bfloat16
    flat = int8_linear(x.reshape(6, 64), w, ws.to(torch.bfloat16), None, None)
    assert torch.equal(got.reshape(6, 16), flat)


def test_the_handle_runs_the_reference_on_cpu() -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4, 32, generator=gen)
    w, ws = _weights(8, 32, gen)
    assert torch.equal(
        handles.int8_linear()(x, w, ws, None, None), int8_linear(x, w, ws, None, None)
    )


def test_a_shared_absmax_gives_each_column_slice_the_whole_rows_codes() -> None:
    """What row-parallel ranks do: quantize their columns with the tokens' absmax over all
    columns, so their codes are those of the unsharded input."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 64, generator=gen)
    whole, scale = quantize_int8(x, None)
    absmax = x.abs().amax(-1, keepdim=True)
    for start in range(0, 64, 16):
        _, s = quantize_int8(x[:, start : start + 16], None, absmax)
        assert torch.equal(s, scale)
    halves = [quantize_int8(x[:, i : i + 32], None, absmax)[0] for i in (0, 32)]
    assert torch.equal(torch.cat(halves, dim=-1), whole)


def test_products_stay_exact_where_onednn_lacks_vnni() -> None:
    """An AVX2-only CPU's oneDNN (forced here by ONEDNN_MAX_CPU_ISA, read at its first use,
    so in a child process) saturates int16 pair sums of full-range codes; the reference
    must not take torch._int_mm there."""
    script = (
        "import torch\n"
        "from tandem.core.kernels.reference.int8_linear import int8_matmul\n"
        "g = torch.Generator().manual_seed(0)\n"
        "a = torch.randint(-128, 128, (32, 1024), dtype=torch.int8, generator=g)\n"
        "b = torch.randint(-128, 128, (512, 1024), dtype=torch.int8, generator=g)\n"
        "print(torch.equal(int8_matmul(a, b).long(), a.long() @ b.long().t()))\n"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False
    )
    assert result.stdout.strip() == "True", result.stderr[-2000:]
