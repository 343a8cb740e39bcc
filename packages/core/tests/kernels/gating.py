"""Inputs of Gated DeltaNet's gates, shared by the tests of each kernel family's ``gdn_gating``."""

from __future__ import annotations

import torch


def gating_inputs(
    dtype: torch.dtype, tokens: int, tails: list[float], seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(b, a, A_log, dt_bias): b and a the two column halves of one [T, 2H] projection (H =
    ``len(tails)``, read in place at a token stride of 2H), A_log from -2 to 4 (decays from
    e^-2 to e^4) and dt_bias. Token 0 holds ``tails``: in a as they are (the softplus past its
    threshold 20, exp underflowing), in b negated (beta's)."""
    gen = torch.Generator().manual_seed(seed)
    heads = len(tails)
    ba = (torch.randn(tokens, 2 * heads, generator=gen) * 8).to(dtype)
    edge = torch.tensor(tails)
    ba[0] = torch.cat((-edge, edge)).to(dtype)
    b, a = torch.split(ba, [heads, heads], dim=-1)
    a_log = torch.linspace(-2.0, 4.0, heads).to(dtype)
    dt_bias = torch.randn(heads, generator=gen).to(dtype)
    return b, a, a_log, dt_bias
