"""The Triton Gated DeltaNet gates against their torch reference, under Triton's interpreter:
``a`` and ``b`` the two column halves of one projection, over the softplus's range (past its
threshold 20, and far enough below zero that exp underflows), several tiles of tokens with a
partial last one.

Error analysis (u = 2^-24; ulp as in test_norms.py): g is float32 on both sides, the sum
``a + dt_bias`` one identical add; exp(A_log) and exp(x) within an ulp (2 u) each side, which
log1p carries over at most as they are, the logs (Goldberg's form here: the log, the
quotient) within 2 ulp, the product rounded on each side: under 16 u relative; 32 u asked,
and where exp(x) leaves the normal range (below 2^-126) an absolute |exp(A_log)| 2^-125
more. beta is sigmoid(b) in float32 (8 u, as the gated SiLU's), rounded once to its dtype:
one ulp, two for the interpreter's truncating bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from tandem.core.kernels.reference.gated_delta_rule import gdn_gating
from tandem.core.kernels.triton import gdn_gating as triton_gating

from ..gating import gating_inputs
from .test_linear_attention import U, check, per_rounding
from .test_norms import ulp

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Six heads, not a power of two: the tile's last columns are masked.
TAILS = [-200.0, -95.0, -30.0, 19.9, 20.5, 90.0]
HEADS = len(TAILS)


# exp(200) overflows to infinity in the interpreter's numpy, as it should (beta is then 0).
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 200])
def test_gdn_gating_matches_the_reference(dtype: torch.dtype, tokens: int) -> None:
    b, a, a_log, dt_bias = gating_inputs(dtype, tokens, TAILS, seed=tokens)
    want_g, want_beta = gdn_gating(a, b, a_log, dt_bias)
    got_g, got_beta = triton_gating.gdn_gating(a, b, a_log, dt_bias)
    assert got_g.dtype is torch.float32 and got_beta.dtype is dtype
    decay = a_log.double().exp()
    check(got_g, want_g, want_g.double().abs() * 32 * U + decay * 2.0**-125 + 1e-45)
    sigmoid = torch.sigmoid(b.double())
    bound = sigmoid * 8 * U + 2.0**-126 + per_rounding(dtype) * ulp(want_beta, dtype).double()
    check(got_beta, want_beta, bound)


def test_no_tokens_launch_nothing() -> None:
    empty = torch.empty(0, HEADS)
    g, beta = triton_gating.gdn_gating(empty, empty, torch.zeros(HEADS), torch.zeros(HEADS))
    assert g.shape == beta.shape == (0, HEADS)
