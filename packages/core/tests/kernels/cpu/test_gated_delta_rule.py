"""The fused CPU decode step of the gated delta rule against the rule evaluated in float64:
a decode batch with continued sequences, a fresh one on a slot of NaN and padding entries on
the null slot 0, q/k/v read from strided views of one projection, two value heads per key
head, the helpers' small heads and the bench model's 64 x 64 ones, float32 and bfloat16;
slots it was not given stay untouched; the registry hands it to the layer on CPU.

Error bound, per output or state entry: every quantity is a chain of +, -, x, / and sqrt on
float32 values (the norms of q and k: Dk + 5 operations; the decay; S^T k: Dk; delta: 2;
the update: 2; S^T q: Dk), so to first order it is within gamma_n = n u / (1 - n u) of
exact times the same expression evaluated on absolute values (Higham, ch. 3), with n = 3 Dk
+ 16 for an output and 2 Dk + 16 for a state entry (u = 2^-24). The absolute expression:
A_S = e^g |S| + |k| (|v| + |k|^T e^g |S|) beta, A_o = |q|^T A_S with q and k the normalised
vectors. bfloat16 outputs are rounded once more, to nearest: one ulp of the output covers it.
"""

from __future__ import annotations

import pytest
import torch

from tandem.core.kernels import handles
from tandem.core.kernels.cpu.gated_delta_rule import native_gated_delta_rule
from tandem.core.kernels.linear_attention_metadata import LinearAttentionMetadata
from tandem.core.kernels.reference.gated_delta_rule import recurrent_gated_delta_rule

from ..reference.test_linear_attention import _meta

U = 2.0**-24


def _gamma(n: int) -> float:
    return n * U / (1 - n * U)


def _exact(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """The step in float64 for one batch ([B, H, ...] inputs, q/k already per value head):
    output, new state and their absolute-value expressions (module docstring)."""
    dk = q.shape[-1]
    qn = q / (q * q).sum(-1, keepdim=True).add(1e-6).sqrt() * dk**-0.5
    kn = k / (k * k).sum(-1, keepdim=True).add(1e-6).sqrt()
    decay = g.exp()[..., None, None]
    s = state * decay
    pred = (kn.unsqueeze(-2) @ s).squeeze(-2)
    delta = (v - pred) * beta[..., None]
    new = s + kn[..., :, None] * delta[..., None, :]
    out = (qn.unsqueeze(-2) @ new).squeeze(-2)
    a_pred = (kn.abs().unsqueeze(-2) @ s.abs()).squeeze(-2)
    a_state = (
        s.abs() + kn.abs()[..., :, None] * ((v.abs() + a_pred) * beta[..., None])[..., None, :]
    )
    a_out = (qn.abs().unsqueeze(-2) @ a_state).squeeze(-2)
    return out, new, a_out, a_state


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """One bfloat16 ulp of each entry (of its binade; at least the smallest normal's)."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0**-126)))
    return torch.pow(2.0, exponent - 7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("key_heads", "value_heads", "key_dim", "value_dim"),
                         [(2, 4, 8, 16), (4, 8, 64, 64)])  # fmt: skip
def test_decode_step_is_within_rounding_of_the_rule_in_float64(
    dtype: torch.dtype, key_heads: int, value_heads: int, key_dim: int, value_dim: int
) -> None:
    kernel = native_gated_delta_rule()
    if kernel is None:
        pytest.skip("no native gated delta rule (no compiler, or switched off)")
    slots, fresh = [2, 0, 5, 0, 1, 6], [False, True, True, False, False, False]
    batch = len(slots)
    gen = torch.Generator().manual_seed(key_dim)
    key_size, value_size = key_heads * key_dim, value_heads * value_dim
    # q, k and v as the layer gets them: views of one projection's rows.
    mixed = torch.randn(batch, 2 * key_size + value_size + 3, generator=gen).to(dtype)
    q = mixed[:, :key_size].view(batch, key_heads, key_dim)
    k = mixed[:, key_size : 2 * key_size].view(batch, key_heads, key_dim)
    v = mixed[:, 2 * key_size : 2 * key_size + value_size].view(batch, value_heads, value_dim)
    g = -torch.rand(batch, value_heads, generator=gen) * 3
    beta = torch.rand(batch, value_heads, generator=gen).to(dtype)
    states = torch.randn(8, value_heads, key_dim, value_dim, generator=gen)
    states[5] = float("nan")  # a fresh sequence's slot: whatever it held is not read
    before = states.clone()
    meta: LinearAttentionMetadata = _meta([1] * batch, slots, fresh, num_decodes=batch)

    got = kernel.recurrent(q, k, v, g, beta, states, meta)

    real = [0, 2, 4, 5]
    start = torch.where(
        torch.tensor(fresh)[real, None, None, None], 0.0, before[[slots[i] for i in real]]
    )
    group = value_heads // key_heads
    qh, kh = (x[real].double().repeat_interleave(group, dim=1) for x in (q, k))
    out, new, a_out, a_state = _exact(
        qh, kh, v[real].double(), g[real].double(), beta[real].double(), start.double()
    )
    bound_out = _gamma(3 * key_dim + 16) * a_out
    if dtype is torch.bfloat16:
        bound_out = bound_out + _ulp(out)
    assert got.dtype is dtype and got.shape == (batch, value_heads, value_dim)
    assert bool(((got[real].double() - out).abs() <= bound_out).all())
    written = states[[slots[i] for i in real]].double()
    assert bool(((written - new).abs() <= _gamma(2 * key_dim + 16) * a_state).all())
    # Slots no sequence named are untouched (3, 4, 7; the NaN slot was written).
    assert torch.equal(states[[3, 4, 7]], before[[3, 4, 7]])


def test_the_layer_gets_the_native_kernel_on_cpu_and_it_matches_the_reference() -> None:
    kernel = native_gated_delta_rule()
    if kernel is None:
        pytest.skip("no native gated delta rule (no compiler, or switched off)")
    handle = handles.recurrent_gated_delta_rule()
    chosen = handle.choose(["cpu"], torch.bfloat16)
    assert getattr(chosen, "__func__", None) is type(kernel).recurrent
    gen = torch.Generator().manual_seed(7)
    q, k = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 2, 8, generator=gen)
    v, g = torch.randn(3, 4, 16, generator=gen), -torch.rand(3, 4, generator=gen)
    beta = torch.rand(3, 4, generator=gen)
    states = torch.randn(4, 4, 8, 16, generator=gen)
    want_states = states.clone()
    meta = _meta([1, 1, 1], [1, 3, 2], [False, False, False], num_decodes=3)
    got = kernel.recurrent(q, k, v, g, beta, states, meta)
    want = recurrent_gated_delta_rule(q, k, v, g, beta, want_states, meta)
    # Both float32, summed in other orders: the bound above for Dk = 8 is about 2e-6 of
    # values of order 1-10.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, want_states, rtol=1e-5, atol=1e-5)
