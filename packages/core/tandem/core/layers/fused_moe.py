"""Routed experts with stacked weights, computed by grouping tokens per expert.

Weights: ``w13`` [E, 2 I, H] (each expert's gate rows, then its up rows) and ``w2`` [E, H, I].
With tensor parallelism every rank holds every expert, its slice of the intermediate dimension
(I / tp rows of gate and of up, I / tp columns of down), and returns partial sums that the
caller all-reduces once.

Compute: the (token, choice) pairs are sorted by expert, each active expert runs two GEMMs on
its contiguous rows, the rows are scaled by their routing weights and added back to their
tokens in expert order (as the reference adds them). Python loops over active experts only,
never over tokens.

Checkpoints name experts either one by one (``experts.{e}.gate_proj.weight``, ``up_proj``,
``down_proj``: Qwen3-MoE releases, and what transformers 5 writes) or fused
(``experts.gate_up_proj`` [E, 2 I, H] and ``experts.down_proj`` [E, H, I]: Qwen3.5-MoE
releases, and transformers' in-memory layout); both load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.collectives import ProcessGroup
from tandem.core.layers.kernels import GATED_ACTIVATIONS, KernelHandle
from tandem.core.layers.linear import _divide
from tandem.core.layers.weights import LazyTensor, copy_checked


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """``x`` [T, H], ``topk_weights``/``topk_ids`` [T, k] -> [T, H]: sum over each token's k
    experts of weight * down(act(gate(x)) * up(x))."""
    act = GATED_ACTIVATIONS[activation]
    num_choices = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # stable: a token's experts stay in id order
    token = order // num_choices
    counts = torch.bincount(flat, minlength=w13.shape[0])
    active = counts.nonzero().squeeze(1)
    rows = x.index_select(0, token)
    out = torch.empty_like(rows)
    start = 0
    for expert, count in zip(active.tolist(), counts[active].tolist(), strict=True):
        end = start + count
        hidden = act(F.linear(rows[start:end], w13[expert]))
        torch.matmul(hidden, w2[expert].t(), out=out[start:end])
        start = end
    out.mul_(topk_weights.reshape(-1)[order].unsqueeze(1).to(out.dtype))
    return torch.zeros_like(x).index_add_(0, token, out)


class FusedMoeExperts(nn.Module):
    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: str,
        group: ProcessGroup,
    ):
        super().__init__()
        if activation not in GATED_ACTIVATIONS:
            supported = ", ".join(sorted(GATED_ACTIVATIONS))
            raise ValueError(f"unsupported activation {activation!r}; supported: {supported}")
        self.group = group
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.local_size = _divide(intermediate_size, group.size, "moe_intermediate_size")
        self.activation = activation
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * self.local_size, hidden_size), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(num_experts, hidden_size, self.local_size), requires_grad=False
        )
        self._kernel = KernelHandle("fused_moe", fused_moe)
        # (expert or -1 for all, part) loaded so far: every expert must be covered.
        self._loaded: set[tuple[int, str]] = set()

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """This rank's partial sums (all-reduce them across ranks)."""
        return self._kernel(x, self.w13, self.w2, topk_weights, topk_ids, self.activation)

    def load_checkpoint_tensor(self, suffix: str, loaded: LazyTensor, name: str) -> None:
        """``suffix``: the name after ``experts.`` (``3.up_proj.weight``, ``gate_up_proj``)."""
        shape = loaded.get_shape()
        lo = self.group.rank * self.local_size
        hi = lo + self.local_size
        size = self.intermediate_size
        if suffix in ("gate_up_proj", "down_proj"):
            self._check_rows(shape[0], name)
            if suffix == "gate_up_proj":
                self._check(shape[1] == 2 * size, name, shape)
                copy_checked(self.w13.data[:, : self.local_size], loaded[:, lo:hi, :], name)
                copy_checked(
                    self.w13.data[:, self.local_size :], loaded[:, size + lo : size + hi, :], name
                )
            else:
                self._check(shape[2] == size, name, shape)
                copy_checked(self.w2.data, loaded[:, :, lo:hi], name)
            self._loaded.add((-1, suffix))
            return
        expert_text, part = suffix.split(".", 1)
        expert = int(expert_text)
        self._check(0 <= expert < self.num_experts, name, shape)
        self._check(shape[1 if part == "down_proj.weight" else 0] == size, name, shape)
        if part == "gate_proj.weight":
            copy_checked(self.w13.data[expert, : self.local_size], loaded[lo:hi, :], name)
        elif part == "up_proj.weight":
            copy_checked(self.w13.data[expert, self.local_size :], loaded[lo:hi, :], name)
        elif part == "down_proj.weight":
            copy_checked(self.w2.data[expert], loaded[:, lo:hi], name)
        else:
            raise ValueError(f"checkpoint tensor {name} is no expert weight this model knows")
        self._loaded.add((expert, part))

    def fully_loaded(self) -> bool:
        fused = {(-1, "gate_up_proj"), (-1, "down_proj")} <= self._loaded
        parts = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
        each = all((e, p) in self._loaded for e in range(self.num_experts) for p in parts)
        return fused or each

    def _check_rows(self, rows: int, name: str) -> None:
        if rows != self.num_experts:
            raise ValueError(
                f"checkpoint tensor {name} stacks {rows} experts, config.json says "
                f"num_experts={self.num_experts}"
            )

    def _check(self, ok: bool, name: str, shape: list[int]) -> None:
        if not ok:
            raise ValueError(
                f"checkpoint tensor {name} (shape {tuple(shape)}) does not fit "
                f"{self.num_experts} experts of intermediate size {self.intermediate_size}"
            )
