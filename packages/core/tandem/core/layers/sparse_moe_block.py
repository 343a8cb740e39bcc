"""The sparse mixture-of-experts MLP of Qwen3-MoE and Qwen3.5-MoE.

Routing: softmax over the router logits in float32, top-k, optionally renormalised to sum to
one, rounded to the model dtype. Qwen3.5-MoE adds a shared expert (a gated MLP every token
goes through) scaled by ``sigmoid(shared_expert_gate(x))``.

Tensor parallelism: the router and the shared-expert gate are replicated; routed and shared
experts split their intermediate dimension, and their partial sums meet in one all-reduce.
int8 routed experts reduce their own exact int32 sums (``quantized_moe.py``): then only the
shared expert's partial sums are reduced here.

Quantized checkpoints (``quant``) quantize the routed experts and, unless the config keeps
it float, the shared expert (as vLLM builds it); the router and the shared expert's gate stay
float. An int8 shared expert over several ranks reduces its own exact int32 sums, as an int8
row-parallel layer does, so its output is the one rank's bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.collectives import ProcessGroup
from tandem.core.kernels import handles
from tandem.core.kernels.reference.elementwise import GATED_ACTIVATIONS
from tandem.core.layers.linear import MergedColumnParallelLinear, row_parallel_projection
from tandem.core.layers.quant_scheme import EXPERTS, QuantScheme, projection_scheme
from tandem.core.layers.quantized_moe import routed_experts
from tandem.core.layers.replicated_linear import ReplicatedLinear


class TopKRouter(ReplicatedLinear):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, normalize: bool):
        super().__init__(hidden_size, num_experts)
        self.top_k = top_k
        self.normalize = normalize
        self._topk = handles.moe_topk_softmax()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights (model dtype) and expert ids, each [T, top_k]."""
        return self.choose(self.matmul(x))

    def choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``route`` of the router's ``logits`` [T, E]."""
        return self._topk(logits, self.top_k, self.normalize)


class SharedExpert(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: str,
        group: ProcessGroup,
        quant: QuantScheme | None = None,
    ):
        super().__init__()
        self.act = GATED_ACTIVATIONS[activation]
        # SiLU-and-mul in the gate/up kernel's epilogue where it has one (CPU: AVX2, AVX-512, AMX).
        self.fuses_silu = activation == "silu"
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size,
            [intermediate_size] * 2,
            bias=False,
            group=group,
            quant=projection_scheme(quant, "mlp.shared_expert.gate_proj"),
        )
        self.down_proj = row_parallel_projection(
            intermediate_size, hidden_size, group, quant, projection="mlp.shared_expert.down_proj"
        )
        # int8 partial sums quantized per rank would differ from one rank's: reduce inside.
        self.reduces_itself = group.size > 1 and self.down_proj.weight_scale is not None

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum (the whole sum where it ``reduces_itself``); the block
        reduces it together with the routed experts'."""
        h = self.gate_up_proj.silu_matmul(x) if self.fuses_silu else None
        if h is None:
            h = self.act(self.gate_up_proj(x))
        out: torch.Tensor = self.down_proj(h) if self.reduces_itself else self.down_proj.partial(h)
        return out


class SparseMoeBlock(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        normalize_topk: bool,
        shared_intermediate_size: int,
        activation: str,
        group: ProcessGroup,
        quant: QuantScheme | None = None,
    ):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in [1, {num_experts}]")
        self.group = group
        self.gate = TopKRouter(hidden_size, num_experts, top_k, normalize_topk)
        self.experts = routed_experts(
            num_experts,
            hidden_size,
            intermediate_size,
            activation,
            group,
            projection_scheme(quant, EXPERTS),
        )
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: ReplicatedLinear | None = None
        if shared_intermediate_size > 0:
            self.shared_expert = SharedExpert(
                hidden_size, shared_intermediate_size, activation, group, quant
            )
            self.shared_expert_gate = ReplicatedLinear(hidden_size, out_features=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate
        logits = gate.matmul(x)
        out = self.experts.routed(x, logits, gate.top_k, gate.normalize)
        if out is None:
            out = self.experts(x, *gate.choose(logits))
        partial = self.experts.partial_sums
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            # The gate is one scalar per token, identical on every rank: scaling the partial
            # sums scales their total.
            shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert.partial(x)
            if self.shared_expert.reduces_itself:
                return (self.group.all_reduce(out) if partial else out) + shared
            if self.group.size > 1 and not partial:
                return out + self.group.all_reduce(shared)
            out = out + shared
        if self.group.size > 1 and partial:
            out = self.group.all_reduce(out)
        return out
