"""The gated delta rule of Gated DeltaNet, per value head h with state S [Dk, Dv]:

    S_t = exp(g_t) * S_{t-1} + k_t (beta_t * (v_t - exp(g_t) * S_{t-1}^T k_t))^T
    o_t = S_t^T q_t

with q and k L2-normalised (q also scaled by Dk^-1/2) and each key head shared by
``Hv / Hk`` consecutive value heads. The recurrent state of a sequence lives in row ``slot``
of a ``[num_slots + 1, Hv, Dk, Dv]`` pool and is updated in place.

Prefill uses the chunked (WY / UT-transform) form of flash-linear-attention's
``chunk_gated_delta_rule``: everything inside a chunk is a handful of batched matmuls and one
triangular solve over all chunks of all sequences at once; only the hand-over of the state from
one chunk to the next is a loop, over the chunk index (all sequences in step). Decode is the
one-step recurrence, batched over sequences. Both compute in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.core.kernels.linear_attention_metadata import LinearAttentionMetadata


def gdn_gating(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gates of each token and value head from ``a`` and ``b`` [T, H]: the decay
    ``g = -exp(A_log) * softplus(a + dt_bias)``, float32 whatever the model dtype (exp(A_log)
    overflows half precision), and ``beta = sigmoid(b)`` in the model dtype."""
    beta = b.sigmoid()
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, beta


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """As flash-linear-attention (and transformers) normalise q and k."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, ...]:
    q = l2norm(q.float()) * q.shape[-1] ** -0.5
    k = l2norm(k.float())
    groups = num_v_heads // q.shape[1]
    if groups > 1:
        q = q.repeat_interleave(groups, dim=1)
        k = k.repeat_interleave(groups, dim=1)
    return q, k


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    meta: LinearAttentionMetadata,
) -> torch.Tensor:
    """One token per decode sequence: ``q``/``k`` [B, Hk, Dk], ``v`` [B, Hv, Dv], ``g``
    (log decay) and ``beta`` [B, Hv] -> [B, Hv, Dv] in ``v``'s dtype."""
    slots = meta.decode_slots
    q, k = _prepare_qk(q, k, v.shape[1])
    state = states.index_select(0, slots).float()
    if not meta.decodes_have_initial_state:
        state = torch.where(meta.decode_has_initial_state.view(-1, 1, 1, 1), state, 0.0)
    state = state * g.float().exp().unsqueeze(-1).unsqueeze(-1)
    predicted = (k.unsqueeze(-2) @ state).squeeze(-2)  # [B, Hv, Dv]: what S already says
    delta = (v.float() - predicted) * beta.float().unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    out = (q.unsqueeze(-2) @ state).squeeze(-2)
    states.index_copy_(0, slots, state.to(states.dtype))
    return out.to(v.dtype)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    meta: LinearAttentionMetadata,
) -> torch.Tensor:
    """The prefill tokens (sequences contiguous, as ``meta.prefill`` lays them out):
    ``q``/``k`` [N, Hk, Dk], ``v`` [N, Hv, Dv], ``g``/``beta`` [N, Hv] -> [N, Hv, Dv]."""
    p = meta.prefill
    assert p is not None
    dtype = v.dtype
    num_heads, dv = v.shape[1], v.shape[2]
    dk = q.shape[2]
    size = p.chunk_size
    q, k = _prepare_qk(q, k, num_heads)

    # Scatter into [chunks + 1, H, C, D]; padding (and the extra zero chunk) has
    # k = v = beta = g = 0, which neither reads nor changes the state.
    rows = (p.num_chunks + 1) * size

    def chunked(x: torch.Tensor) -> torch.Tensor:
        padded = x.new_zeros((rows, *x.shape[1:]))
        padded[p.chunk_token_index] = x
        return padded.view(p.num_chunks + 1, size, *x.shape[1:]).transpose(1, 2)

    q, k = chunked(q), chunked(k)
    v = chunked(v.float())
    beta = chunked(beta.float())  # [M, H, C]
    decay = chunked(g.float()).cumsum(-1)  # log of the decay from the chunk start to t

    # Within a chunk: decay between positions j <= i, and the UT system of the delta rule.
    upper = torch.ones(size, size, dtype=torch.bool, device=q.device).triu(diagonal=1)
    pairwise = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * pairwise  # unit lower-triangular once solved
    intra = (q @ k.transpose(-1, -2)) * pairwise
    rhs = torch.cat((v * beta.unsqueeze(-1), k_beta * decay.exp().unsqueeze(-1)), dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    values, k_read = solved.split((dv, dk), dim=-1)  # new values; keys reading the old state

    q_read = q * decay.exp().unsqueeze(-1)
    k_write = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    chunk_decay = decay[..., -1].exp().unsqueeze(-1).unsqueeze(-1)  # [M, H, 1, 1]

    state = states.index_select(0, p.state_slots).float()
    if not p.all_have_initial_state:
        state = torch.where(p.has_initial_state.view(-1, 1, 1, 1), state, 0.0)
    out = torch.zeros_like(values)
    for i in range(p.chunk_table.shape[1]):
        ids = p.chunk_table[:, i]
        corrected = values[ids] - k_read[ids] @ state
        out[ids] = q_read[ids] @ state + intra[ids] @ corrected
        state = state * chunk_decay[ids] + k_write[ids].transpose(-1, -2) @ corrected
    states.index_copy_(0, p.state_slots, state.to(states.dtype))
    flat = out.transpose(1, 2).reshape(rows, num_heads, dv)
    return flat.index_select(0, p.chunk_token_index).to(dtype)
