"""Gated DeltaNet's gates in Triton (``reference/gated_delta_rule.py``, ``gdn_gating``): per
token and value head the decay ``g = -exp(A_log) * softplus(a + dt_bias)`` in float32 and
``beta = sigmoid(b)`` in the model dtype, from the b and a columns of the projection that
computes them (``in_proj_qkvz``, or ``in_proj_ba`` apart) read in place (token strides of
their own). One kernel instead of the reference's
eight elementwise ops; a program per tile of ``ROWS`` tokens, all of a rank's heads (a few)
in one tile row.

Rounding as the reference: inputs widen to float32, every step is float32, g is stored as
computed and beta rounded once to its dtype. Softplus as torch's: ``x`` above the threshold
20, else ``log1p(exp(x))``, here ``log(1 + e) * e / ((1 + e) - 1)`` (Goldberg's form, which
cancels the rounding of ``1 + e``; ``e`` itself where ``1 + e`` rounds to 1), since Triton
has no log1p of its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tokens per program: a decode step's batch in one or a few programs.
ROWS = 64
SOFTPLUS_THRESHOLD = 20.0


@triton.jit
def _gdn_gating(
    a_ptr,
    b_ptr,
    a_log_ptr,
    dt_bias_ptr,
    g_ptr,
    beta_ptr,
    tokens,
    heads,
    a_stride,
    b_stride,
    THRESHOLD: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < heads
    mask = (rows[:, None] < tokens) & col_mask[None, :]
    a = tl.load(a_ptr + rows[:, None] * a_stride + cols[None, :], mask=mask, other=0.0)
    b = tl.load(b_ptr + rows[:, None] * b_stride + cols[None, :], mask=mask, other=0.0)
    a_log = tl.load(a_log_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    x = a.to(tl.float32) + dt_bias[None, :]
    e = tl.exp(tl.minimum(x, THRESHOLD))
    u = 1.0 + e
    d = u - 1.0
    log1p = tl.where(d == 0.0, e, tl.log(u) * (e / tl.where(d == 0.0, 1.0, d)))
    softplus = tl.where(x > THRESHOLD, x, log1p)
    g = -tl.exp(a_log)[None, :] * softplus
    beta = 1.0 / (1.0 + tl.exp(-b.to(tl.float32)))
    out = rows[:, None] * heads + cols[None, :]
    tl.store(g_ptr + out, g, mask=mask)
    tl.store(beta_ptr + out, beta.to(beta_ptr.dtype.element_ty), mask=mask)


def gdn_gating(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) [T, H] from ``a`` and ``b`` [T, H] (any token stride), ``a_log`` and
    ``dt_bias`` [H]: g float32, beta in the dtype of ``b``."""
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()
    a_log, dt_bias = a_log.contiguous(), dt_bias.contiguous()
    tokens, heads = a.shape
    g = torch.empty(tokens, heads, dtype=torch.float32, device=a.device)
    beta = torch.empty(tokens, heads, dtype=b.dtype, device=b.device)
    if tokens:
        _gdn_gating[(triton.cdiv(tokens, ROWS),)](
            a, b, a_log, dt_bias, g, beta, tokens, heads, a.stride(0), b.stride(0),
            THRESHOLD=SOFTPLUS_THRESHOLD, ROWS=ROWS, BLOCK=triton.next_power_of_2(heads),
        )  # fmt: skip
    return g, beta
