"""Routed experts with stacked weights, computed by grouping tokens per expert.

Weights: ``w13`` [E, 2 I, H] (each expert's gate rows, then its up rows) and ``w2`` [E, H, I].
With tensor parallelism every rank holds every expert, its slice of the intermediate dimension
(I / tp rows of gate and of up, I / tp columns of down), and returns partial sums that the
caller all-reduces once.

Compute: the (token, choice) pairs are sorted by expert, each active expert runs two GEMMs on
its contiguous rows, the rows are scaled by their routing weights and added back to their
tokens in expert order (as the reference adds them). Python loops over active experts only,
never over tokens.

On CPUs where the AVX2 kernel serves float32 (``pack_expert_weights``), the experts'
weights are packed once at load and each projection is one grouped call for every active
expert (``Avx2Linear.grouped_matmul``): the per-expert offsets stay a tensor the kernel
reads (no host sync for the routing), and the (expert, panel) pairs are the work the cores
share, where per-expert GEMMs of a dozen decode rows each left them mostly waiting on
dispatch. The plain weights are then dropped: one copy of the model.

Checkpoints name experts either one by one (``experts.{e}.gate_proj.weight``, ``up_proj``,
``down_proj``: Qwen3-MoE releases, and what transformers 5 writes) or fused
(``experts.gate_up_proj`` [E, 2 I, H] and ``experts.down_proj`` [E, H, I]: Qwen3.5-MoE
releases, and transformers' in-memory layout); both load.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from tandem.collectives import ProcessGroup
from tandem.core.layers.activation import gated_activation_kernel
from tandem.core.layers.avx2_linear import Avx2Linear, PackedExperts, pack_experts
from tandem.core.layers.kernels import GATED_ACTIVATIONS, KernelHandle
from tandem.core.layers.linear import _divide
from tandem.core.layers.packed_linear import native_kernel, packing_enabled
from tandem.core.layers.weights import LazyTensor, copy_checked

logger = logging.getLogger(__name__)


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


def grouped_fused_moe(
    x: torch.Tensor,
    kernel: Avx2Linear,
    w13: PackedExperts,
    w2: PackedExperts,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act: KernelHandle[torch.Tensor],
) -> torch.Tensor:
    """``fused_moe`` with each projection one grouped kernel call over every expert."""
    num_choices = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # stable: a token's experts stay in id order
    token = order // num_choices
    offsets = torch.zeros(w13.experts + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(flat, minlength=w13.experts), 0, out=offsets[1:])
    rows = x.index_select(0, token)
    hidden = act(kernel.grouped_matmul(rows, w13, offsets))
    out = kernel.grouped_matmul(hidden, w2, offsets)
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
        # Set by pack(): the grouped CPU kernel and both projections in its layout.
        self._grouped: tuple[Avx2Linear, PackedExperts, PackedExperts] | None = None
        self._act = gated_activation_kernel(activation)

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """This rank's partial sums (all-reduce them across ranks)."""
        grouped = self._grouped
        if grouped is not None:
            kernel, w13, w2 = grouped
            return grouped_fused_moe(x, kernel, w13, w2, topk_weights, topk_ids, self._act)
        return self._kernel(x, self.w13, self.w2, topk_weights, topk_ids, self.activation)

    def pack(self, kernel: Avx2Linear) -> bool:
        """Pack both projections for ``kernel``'s grouped calls, in place of the plain
        weights (the parameters then hold the packed layout, so the model's size counts
        them once); False (nothing changed) where a shape does not fit its panels."""
        w13, w2 = pack_experts(self.w13.data), pack_experts(self.w2.data)
        if w13 is None or w2 is None:
            return False
        self._grouped = (kernel, w13, w2)
        self.w13.data, self.w2.data = w13.packed, w2.packed
        return True

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


def pack_expert_weights(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Pack the routed experts of a loaded CPU model for the grouped AVX2 kernel, where it
    serves ``dtype`` (float32 on AVX2 CPUs without AVX-512); returns how many blocks."""
    if device.type != "cpu" or dtype is not torch.float32 or not packing_enabled(dtype):
        return 0
    kernel = native_kernel(dtype)
    if not isinstance(kernel, Avx2Linear):
        return 0
    packed = sum(
        module.pack(kernel) for module in model.modules() if isinstance(module, FusedMoeExperts)
    )
    if packed:
        logger.info("packed the routed experts of %d layers for grouped %s calls", packed,
                    kernel.name)  # fmt: skip
    return packed
