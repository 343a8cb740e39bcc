"""The gated activations ``act(gate) * up`` over a fused [gate | up] projection in Triton: a
program per (row, column tile), reading the gate and the up tile of one row and writing their
product, so the [rows, 2 I] projection is read once and only the [rows, I] result is written.

Roundings are those of the torch reference (``reference/elementwise.py``): torch computes
``F.silu``/``F.gelu`` of a float16 or bfloat16 tensor in float32 and rounds the activation to
the input dtype, then multiplies by ``up`` and rounds again. The kernel widens on load, takes
the activation in float32 with torch's formulas (``x / (1 + exp(-x))``; ``x / 2 * (1 +
erf(x / sqrt 2))``; the tanh form through the identity ``(1 + tanh z) / 2 = 1 / (1 + exp(-2
z))``, which avoids the cancellation of ``1 + tanh z`` for negative z), rounds it to the input
dtype, multiplies in float32 (exact for two float16 or bfloat16 values) and rounds once more.
The one activation kernel serves all three (``ACTIVATION`` is a compile-time choice), and
``gated_<name>`` is the wrapper a handle picks per activation name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

SILU, GELU, GELU_TANH = 0, 1, 2
ACTIVATIONS = {"silu": SILU, "gelu": GELU, "gelu_pytorch_tanh": GELU_TANH}
# Columns per program: a row of a served model's intermediate size in a few tiles.
BLOCK = 1024


@triton.jit
def apply_activation(g, ACTIVATION: tl.constexpr):
    """``act(g)`` of a float32 tile, by the formula torch uses for ``ACTIVATION``."""
    if ACTIVATION == 0:
        a = g / (1.0 + tl.exp(-g))
    elif ACTIVATION == 1:
        a = g * 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))
    else:
        # sqrt(2 / pi) * (g + 0.044715 g^3), doubled: 0.5 (1 + tanh z) = 1 / (1 + exp(-2 z)).
        z2 = 1.5957691216057308 * (g + 0.044715 * g * g * g)
        a = g / (1.0 + tl.exp(-z2))
    return a


@triton.jit
def _gated_rows(
    gate_up_ptr,
    out_ptr,
    in_stride,
    out_stride,
    n_cols,
    ACTIVATION: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    base = gate_up_ptr + row * in_stride + cols
    g = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + n_cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    a = apply_activation(g, ACTIVATION).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (a * up).to(dtype), mask=mask)


def gated_activation(gate_up: torch.Tensor, activation: int) -> torch.Tensor:
    """``gate_up`` [..., 2 I] -> [..., I] with the activation ``activation`` (``SILU``,
    ``GELU``, ``GELU_TANH``) of the first half times the second."""
    # The projection is [T, 2 I] in every model: no reshape or view around the launch, whose
    # host time is what a call of this memory-bound kernel costs at serving sizes.
    rows = gate_up if gate_up.dim() == 2 else gate_up.reshape(-1, gate_up.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    num_rows, width = rows.shape
    inter = width // 2
    out = rows.new_empty((num_rows, inter))
    if num_rows and inter:
        block = min(BLOCK, triton.next_power_of_2(inter))
        grid = (num_rows, triton.cdiv(inter, block))
        _gated_rows[grid](
            rows, out, rows.stride(0), out.stride(0), inter, ACTIVATION=activation, BLOCK=block
        )
    return out if gate_up.dim() == 2 else out.view(*gate_up.shape[:-1], inter)


def gated_silu(gate_up: torch.Tensor) -> torch.Tensor:
    return gated_activation(gate_up, SILU)


def gated_gelu(gate_up: torch.Tensor) -> torch.Tensor:
    return gated_activation(gate_up, GELU)


def gated_gelu_pytorch_tanh(gate_up: torch.Tensor) -> torch.Tensor:
    return gated_activation(gate_up, GELU_TANH)


# Per activation name, as ``reference.elementwise.GATED_ACTIVATIONS``.
GATED_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": gated_silu,
    "gelu": gated_gelu,
    "gelu_pytorch_tanh": gated_gelu_pytorch_tanh,
}
