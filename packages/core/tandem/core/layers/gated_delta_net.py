"""Gated DeltaNet, the linear-attention token mixer of Qwen3.5, with tensor parallelism.

    [q | k | v | z] = x W_qkvz,  [b | a] = x W_ba   (in_proj_qkv, in_proj_z; in_proj_b, in_proj_a)
    q, k, v = silu(causal_conv1d([q | k | v]))
    beta = sigmoid(b),  g = -exp(A_log) * softplus(a + dt_bias)
    o = gated_delta_rule(q, k, v, g, beta);  out = W_out gated_rms_norm(o, z)

Tensor parallelism splits the heads: rank r owns key heads ``[r Hk/tp, (r+1) Hk/tp)`` and the
value heads they serve, with their conv channels, z/b/a rows, A_log/dt_bias entries and state;
``out_proj`` is row-parallel (one all-reduce per layer).

b and a are computed by ``in_proj_qkvz`` too (sections q, k, v, z, b, a) where the two
checkpoint pairs are stored alike (``gates_fused`` says when): one matmul instead of two. On
CPU the fused weight is padded to our kernel's panels (``PackableLinear.pad_outputs``); b and
a alone (2 x heads outputs) fell back to oneDNN, a dispatch and a pass over the input per
layer and step. Otherwise ``in_proj_ba`` computes them apart.

Quantized checkpoints (``quant``): the two input projections and ``out_proj`` each quantized
or float as the config says (vLLM fuses the same pairs, so a checkpoint stores each pair
alike); conv1d, A_log, dt_bias and the norm are always float.

State, per sequence in its slot (bound once with ``bind_state``, like ``bind_cache``):
conv state ``[num_slots + 1, conv_channels, K - 1]`` in the model dtype (it holds raw projected
inputs, exactly representable in that dtype) and recurrent state
``[num_slots + 1, value_heads, k_head_dim, v_head_dim]`` in float32 (it accumulates over the
whole sequence; rounding it to half precision at every token would drift, and the reference
keeps it in float32 as well). Shapes are per rank. Slot 0 is the null slot.

Sequences that verify speculative drafts run their tokens a position at a time through the
decode kernels, and the state after each position but the last is copied to a scratch row
(``LinearVerifyIndices``): the engine rolls a sequence back to its last accepted token by
copying that row into its slot before the next step.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.collectives import ProcessGroup
from tandem.core.kernels import handles
from tandem.core.kernels.attention_metadata import AttentionMetadata
from tandem.core.kernels.linear_attention_metadata import (
    LinearAttentionMetadata,
    LinearVerifyIndices,
)
from tandem.core.kernels.reference.causal_conv1d import check_activation
from tandem.core.layers.gated_rms_norm import GatedRMSNorm
from tandem.core.layers.linear import _divide, row_parallel_projection
from tandem.core.layers.quant_scheme import (
    QuantScheme,
    W4A16Scheme,
    W8A8Scheme,
    projection_scheme,
)
from tandem.core.layers.sectioned_linear import SectionedColumnParallelLinear, load_sections
from tandem.core.layers.weights import LazyTensor, copy_checked, read_shard

RECURRENT_STATE_DTYPE = torch.float32

# Checkpoint tensor -> the sections it holds of in_proj_qkvz (q, k, v, z) and in_proj_ba;
# of in_proj_qkvz (q, k, v, z, b, a) where it computes b and a too.
QKVZ_TENSORS = {"in_proj_qkv": [0, 1, 2], "in_proj_z": [3]}
BA_TENSORS = {"in_proj_b": [0], "in_proj_a": [1]}
QKVZBA_TENSORS = {**QKVZ_TENSORS, "in_proj_b": [4], "in_proj_a": [5]}


def gates_fused(quant: QuantScheme | None) -> bool:
    """Whether ``in_proj_qkvz`` computes b and a too (else ``in_proj_ba``): where both
    checkpoint pairs get the same scheme; not a static W8A8 one, whose fused input scale
    would be the maximum over all four tensors' (vLLM's over each pair's), nor 4-bit in
    activation order, where all four would have to share one ``g_idx`` (each pair must)."""
    qkvz = projection_scheme(quant, "linear_attn.in_proj_qkv")
    ba = projection_scheme(quant, "linear_attn.in_proj_b")
    if isinstance(qkvz, W8A8Scheme) and qkvz.static:
        return False
    return qkvz == ba and not (isinstance(qkvz, W4A16Scheme) and qkvz.desc_act)


class DepthwiseConvWeight(nn.Module):
    """The conv taps ``[channels, K]`` of this rank's q/k/v channels (``[C, 1, K]`` in
    checkpoints), split as the q/k/v sections of ``in_proj_qkvz``."""

    def __init__(self, in_proj: SectionedColumnParallelLinear, kernel_size: int):
        super().__init__()
        self.in_proj = [in_proj]  # a list: a reference, not a second registered submodule
        channels = sum(in_proj.local_sizes[:3])
        self.weight = nn.Parameter(torch.empty(channels, kernel_size), requires_grad=False)

    def load_weight(self, param: nn.Parameter, loaded: LazyTensor, name: str) -> None:
        load_sections(param.data, loaded, [0, 1, 2], self.in_proj[0], name)


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        k_head_dim: int,
        v_head_dim: int,
        conv_kernel_size: int,
        activation: str,
        eps: float,
        group: ProcessGroup,
        quant: QuantScheme | None = None,
        fuse_gates: bool | None = None,
    ):
        """``fuse_gates``: whether ``in_proj_qkvz`` computes b and a too; None: where
        ``gates_fused(quant)`` says."""
        super().__init__()
        check_activation(activation)
        if num_v_heads % num_k_heads:
            raise ValueError(
                f"linear_num_value_heads ({num_v_heads}) is not a multiple of "
                f"linear_num_key_heads ({num_k_heads})"
            )
        self.group = group
        self.activation = activation
        self.num_k_heads = _divide(num_k_heads, group.size, "linear_num_key_heads")
        self.num_v_heads = _divide(num_v_heads, group.size, "linear_num_value_heads")
        self.k_head_dim = k_head_dim
        self.v_head_dim = v_head_dim
        self.conv_kernel_size = conv_kernel_size
        key_dim = num_k_heads * k_head_dim
        value_dim = num_v_heads * v_head_dim
        fused = gates_fused(quant) if fuse_gates is None else fuse_gates
        qkvz_sections = [key_dim, key_dim, value_dim, value_dim]
        gate_sections = [num_v_heads, num_v_heads]
        self.in_proj_qkvz = SectionedColumnParallelLinear(
            hidden_size,
            qkvz_sections + gate_sections if fused else qkvz_sections,
            QKVZBA_TENSORS if fused else QKVZ_TENSORS,
            group,
            quant=projection_scheme(quant, "linear_attn.in_proj_qkv"),
        )
        # Its output is only split (forward), so its packed weight may be padded.
        self.in_proj_qkvz.pad_outputs = True
        self.in_proj_ba: SectionedColumnParallelLinear | None = None
        if not fused:
            self.in_proj_ba = SectionedColumnParallelLinear(
                hidden_size,
                gate_sections,
                BA_TENSORS,
                group,
                quant=projection_scheme(quant, "linear_attn.in_proj_b"),
            )
        self.key_size = self.num_k_heads * k_head_dim
        self.value_size = self.num_v_heads * v_head_dim
        self.conv_channels = 2 * self.key_size + self.value_size
        self.conv1d = DepthwiseConvWeight(self.in_proj_qkvz, conv_kernel_size)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.norm = GatedRMSNorm(v_head_dim, eps)
        self.out_proj = row_parallel_projection(
            value_dim, hidden_size, group, quant, projection="linear_attn.out_proj"
        )
        self.conv_state = torch.empty(0)
        self.recurrent_state = torch.empty(0)
        self._conv_prefill = handles.causal_conv1d_prefill()
        self._conv_update = handles.causal_conv1d_update()
        self._delta_chunked = handles.chunk_gated_delta_rule()
        self._delta_step = handles.recurrent_gated_delta_rule()
        self._conv_verify = handles.causal_conv1d_verify()
        self._delta_verify = handles.recurrent_gated_delta_verify()
        self._gating = handles.gdn_gating()

    def load_weight(self, param: nn.Parameter, loaded: LazyTensor, name: str) -> None:
        """A_log and dt_bias: this rank's value heads."""
        start = self.group.rank * self.num_v_heads
        copy_checked(param.data, read_shard(loaded, 0, start, self.num_v_heads), name)

    def conv_state_shape(self, num_slots: int) -> tuple[int, ...]:
        return (num_slots + 1, self.conv_channels, self.conv_kernel_size - 1)

    def recurrent_state_shape(self, num_slots: int) -> tuple[int, ...]:
        return (num_slots + 1, self.num_v_heads, self.k_head_dim, self.v_head_dim)

    def state_bytes_per_slot(self, dtype: torch.dtype) -> int:
        """Bytes one sequence's state takes in this layer on this rank (conv state in
        ``dtype``, the model's)."""
        conv = self.conv_channels * (self.conv_kernel_size - 1) * dtype.itemsize
        recurrent = self.num_v_heads * self.k_head_dim * self.v_head_dim
        return conv + recurrent * RECURRENT_STATE_DTYPE.itemsize

    def bind_state(self, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None:
        """Attach this layer's state pools (shapes from ``conv_state_shape`` and
        ``recurrent_state_shape``; recurrent state in ``RECURRENT_STATE_DTYPE``)."""
        self.conv_state = conv_state
        self.recurrent_state = recurrent_state

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        lin = meta.linear
        if lin is None:
            raise ValueError("a linear-attention layer needs AttentionMetadata.linear")
        mixed, z, b, a = self._project(x)
        mixed = self._conv(mixed, lin)
        q, k, v = torch.split(mixed, [self.key_size, self.key_size, self.value_size], dim=-1)
        num_tokens = x.shape[0]
        q = q.view(num_tokens, self.num_k_heads, self.k_head_dim)
        k = k.view(num_tokens, self.num_k_heads, self.k_head_dim)
        v = v.view(num_tokens, self.num_v_heads, self.v_head_dim)
        # g in float32 whatever the model dtype: exp(A_log) overflows half precision.
        g, beta = self._gating(a, b, self.A_log, self.dt_bias)
        core = self._delta(q, k, v, g, beta, lin)
        # z as [T, H, Dv], a view of the projection (the CPU kernel reads it in place).
        gate = z.view(num_tokens, self.num_v_heads, self.v_head_dim)
        out = self.norm(core.view(gate.shape), gate)
        result: torch.Tensor = self.out_proj(out.view(num_tokens, self.value_size))
        return result

    def _project(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv input (q | k | v), z, b and a of ``x``: views of the projections."""
        gates = [self.num_v_heads, self.num_v_heads]
        if self.in_proj_ba is None:
            mixed, z, b, a = self.in_proj_qkvz(x).split(
                [self.conv_channels, self.value_size, *gates], dim=-1
            )
            return mixed, z, b, a
        mixed, z = self.in_proj_qkvz(x).split([self.conv_channels, self.value_size], dim=-1)
        b, a = self.in_proj_ba(x).split(gates, dim=-1)
        return mixed, z, b, a

    def _conv(self, mixed: torch.Tensor, lin: LinearAttentionMetadata) -> torch.Tensor:
        nd = lin.num_decodes
        first_prefill = nd + lin.num_verify_tokens
        weight = self.conv1d.weight
        parts = []
        if nd:
            parts.append(
                self._conv_update(mixed[:nd], weight, self.conv_state, lin, self.activation)
            )
        if lin.verify is not None:
            parts.append(self._verify_conv(mixed[nd:first_prefill], lin.verify))
        if lin.prefill is not None:
            parts.append(
                self._conv_prefill(
                    mixed[first_prefill:], weight, self.conv_state, lin, self.activation
                )
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _verify_conv(self, x: torch.Tensor, verify: LinearVerifyIndices) -> torch.Tensor:
        return self._conv_verify(
            x, self.conv1d.weight, self.conv_state, verify, self.activation, self._conv_update
        )

    def _delta(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        lin: LinearAttentionMetadata,
    ) -> torch.Tensor:
        nd = lin.num_decodes
        f = nd + lin.num_verify_tokens  # the first prefill token
        state = self.recurrent_state
        parts = []
        if nd:
            parts.append(self._delta_step(q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd], state, lin))
        if lin.verify is not None:
            parts.append(
                self._verify_delta(q[nd:f], k[nd:f], v[nd:f], g[nd:f], beta[nd:f], lin.verify)
            )
        if lin.prefill is not None:
            parts.append(self._delta_chunked(q[f:], k[f:], v[f:], g[f:], beta[f:], state, lin))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _verify_delta(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        verify: LinearVerifyIndices,
    ) -> torch.Tensor:
        return self._delta_verify(q, k, v, g, beta, self.recurrent_state, verify, self._delta_step)
