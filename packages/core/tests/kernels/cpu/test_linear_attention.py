"""The fused CPU decode steps of Gated DeltaNet: the causal conv1d update against the conv in
float64 and the torch reference, and the gated delta rule's step against the rule evaluated in
float64:
a decode batch with continued sequences, a fresh one on a slot of NaN and padding entries on
the null slot 0, q/k/v read from strided views of one projection, two value heads per key
head, the helpers' small heads and the bench model's 64 x 64 ones, float32 and bfloat16;
slots it was not given stay untouched; the registry hands it to the layer on CPU.

Error bound, per output or state entry: every quantity is a chain of +, -, x, / and sqrt on
float32 values. The kernel evaluates delta = beta (v - e^g S^T k), the state e^g S + k
delta^T and the output e^g S^T q + (k^T q) delta (the same value as (e^g S + k delta^T)^T q):
the norms of q and k: Dk + 5 operations; the decay; S^T k, S^T q and k^T q: Dk each, in
any order of summation; delta: 3; the update: 2; the output's sum: 2. An output's longest
chain is then 3 Dk + 11 and a state entry's 2 Dk + 11, so to first order each is within
gamma_n = n u / (1 - n u) of exact times the same expression evaluated on absolute values
(Higham, ch. 3), with n = 3 Dk + 16 for an output and 2 Dk + 16 for a state entry
(u = 2^-24), the rest of n for exp's few ulps. The absolute expression:
A_S = e^g |S| + |k| (|v| + |k|^T e^g |S|) beta, A_o = |q|^T A_S with q and k the normalised
vectors. bfloat16 outputs are rounded once more, to nearest: one ulp of the output covers it.

Conv update: K products of values exact in float32 summed in float32, within gamma_K of the
exact sum times the sum of |products|; then rounded to the input dtype (float32: exact) before
SiLU, whose slope is within [-0.1, 1.1]; SiLU's exp and division add a few u of the output,
and the output's rounding one ulp of it (bfloat16): bound 1.1 (gamma_K S + ulp(y)) + 4 u |out|
+ ulp(out), y the conv's output, S the sum of |products|. States hold raw inputs: exact.
"""

from __future__ import annotations

import pytest
import torch

from tandem.core.kernels import handles
from tandem.core.kernels.cpu.linear_attention import native_linear_attention
from tandem.core.kernels.linear_attention_metadata import LinearAttentionMetadata
from tandem.core.kernels.reference.causal_conv1d import causal_conv1d_update
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
    kernel = native_linear_attention()
    if kernel is None:
        pytest.skip("no native linear-attention kernels (no compiler, or switched off)")
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


def _ulp_of(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _ulp(x) if dtype is torch.bfloat16 else torch.zeros_like(x)


# 4 taps: the compiled-for kernel size (Qwen3.5's); 3 and 5: the run-time one.
@pytest.mark.parametrize("taps", [3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_update_is_within_rounding_of_the_conv_in_float64(
    dtype: torch.dtype, taps: int
) -> None:
    kernel = native_linear_attention()
    if kernel is None:
        pytest.skip("no native linear-attention kernels (no compiler, or switched off)")
    slots, fresh = [2, 0, 5, 0, 1], [False, True, True, False, False]
    batch, channels = len(slots), 40
    gen = torch.Generator().manual_seed(11)
    rows = torch.randn(batch, channels + 9, generator=gen).to(dtype)
    x = rows[:, 3 : 3 + channels]  # a strided view, as the layer's split of in_proj
    weight = (torch.randn(channels, taps, generator=gen) * 0.5).to(dtype)
    states = torch.randn(7, channels, taps - 1, generator=gen).to(dtype)
    states[5] = float("nan")
    before = states.clone()
    meta = _meta([1] * batch, slots, fresh, num_decodes=batch)

    got = kernel.conv_update(x, weight, states, meta, "silu")

    real = [0, 2, 4]
    start = before[[slots[i] for i in real]].double()
    start = torch.where(torch.tensor(fresh)[real, None, None], 0.0, start)
    window = torch.cat((start, x[real].double().unsqueeze(-1)), dim=-1)
    products = window * weight.double()
    y = products.sum(-1)
    out = torch.nn.functional.silu(y)
    bound = 1.1 * (_gamma(taps) * products.abs().sum(-1) + _ulp_of(y, dtype))
    bound = bound + 4 * U * out.abs() + _ulp_of(out, dtype)
    assert bool(((got[real].double() - out).abs() <= bound).all())
    # The states shifted by one, exactly: the raw inputs.
    assert torch.equal(states[[slots[i] for i in real]].double(), window[..., 1:])
    assert torch.equal(states[[3, 4, 6]], before[[3, 4, 6]])
    # And the torch reference on the same inputs, within the same bound twice.
    want_states = before.clone()
    want = causal_conv1d_update(x, weight, want_states, meta, "silu")
    assert bool(((got[real].double() - want[real].double()).abs() <= 2 * bound).all())
    assert torch.equal(states[1:], want_states[1:])


def test_the_layer_gets_the_native_kernels_on_cpu_and_they_match_the_reference() -> None:
    kernel = native_linear_attention()
    if kernel is None:
        pytest.skip("no native linear-attention kernels (no compiler, or switched off)")
    chosen = handles.recurrent_gated_delta_rule().choose(["cpu"], torch.bfloat16)
    assert getattr(chosen, "__func__", None) is type(kernel).recurrent
    chosen = handles.causal_conv1d_update().choose(["cpu"], torch.bfloat16)
    assert getattr(chosen, "__func__", None) is type(kernel).conv_update
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
