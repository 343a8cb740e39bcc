"""Qwen3.5's full-attention layer over the paged KV cache: grouped-query attention with
zero-centred q/k RMSNorm, partial rotary and a per-head output gate (q_proj yields each head's
query followed by its gate; the attention output is multiplied by ``sigmoid(gate)``).

Tensor parallelism as in the dense decoder: query heads (with their gates) split across ranks,
KV heads split or, when fewer than ranks, replicated; o_proj row-parallel. Quantized
(``quant``), q_proj's scales follow its rows (each head's query, then its gate) as the float
rows do.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.collectives import ProcessGroup
from tandem.core.kernels import handles
from tandem.core.kernels.attention_metadata import AttentionMetadata
from tandem.core.layers.attention import PagedAttention
from tandem.core.layers.linear import QKVParallelLinear, RowParallelLinear
from tandem.core.layers.partial_rotary import PartialRotaryEmbedding
from tandem.core.layers.quant_scheme import QuantScheme, projection_scheme
from tandem.core.layers.zero_centered_rms_norm import ZeroCenteredRMSNorm


class GatedAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        eps: float,
        group: ProcessGroup,
        quant: QuantScheme | None = None,
    ):
        super().__init__()
        self.head_dim = head_dim
        self.qkv_proj = QKVParallelLinear(
            hidden_size,
            head_dim,
            num_heads,
            num_kv_heads,
            bias=bias,
            group=group,
            gated_query=True,
            quant=projection_scheme(quant, "self_attn.q_proj"),
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = 2 * self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(
            num_heads * head_dim,
            hidden_size,
            bias=bias,
            group=group,
            quant=projection_scheme(quant, "self_attn.o_proj"),
        )
        self.q_norm = ZeroCenteredRMSNorm(head_dim, eps)
        self.k_norm = ZeroCenteredRMSNorm(head_dim, eps)
        # The q/k norms and partial rotary: one in-place pass over q (inside the query|gate
        # columns) and k on CPU, instead of two norms, two rotaries and two copies.
        self._qk = handles.qk_norm_rotary()
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, head_dim, scale=head_dim**-0.5
        )

    def forward(
        self,
        x: torch.Tensor,
        rotary: PartialRotaryEmbedding,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``rotary``: the model's table, shared by every layer (indexed at ``positions``)."""
        num_tokens = x.shape[0]
        query_gate, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], -1)
        query_gate = query_gate.view(num_tokens, self.num_heads, 2 * self.head_dim)
        q, gate = query_gate.split([self.head_dim, self.head_dim], dim=-1)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self._qk(
            q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, rotary.cos, rotary.sin,
            positions, True, rotary.rotary_dim,
        )  # fmt: skip
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, meta) * torch.sigmoid(gate.reshape(num_tokens, -1))
        result: torch.Tensor = self.o_proj(out)
        return result
