"""Routed experts with stacked weights, computed by grouping tokens per expert.

Weights: ``w13`` [E, 2 I, H] (each expert's gate rows, then its up rows) and ``w2`` [E, H, I].
With tensor parallelism every rank holds every expert, its slice of the intermediate dimension
(I / tp rows of gate and of up, I / tp columns of down), and returns partial sums that the
caller all-reduces once.

Compute: the ``fused_moe`` kernel (``kernels/handles.py``). On CPUs where a grouped kernel
serves the model's dtype (``pack_expert_weights``: the AVX2 float32 kernel, the AVX-512
float32 and AVX512-BF16 ones, the AMX bfloat16 one), the experts' weights are packed once at
load and each projection is one grouped call for every active expert
(``kernels/cpu/grouped_moe.py``); the plain weights are then dropped: one copy of the model.

Checkpoints name experts either one by one (``experts.{e}.gate_proj.weight``, ``up_proj``,
``down_proj``: Qwen3-MoE releases, and what transformers 5 writes) or fused
(``experts.gate_up_proj`` [E, 2 I, H] and ``experts.down_proj`` [E, H, I]: Qwen3.5-MoE
releases, and transformers' in-memory layout); both load.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from tandem.collectives import ProcessGroup
from tandem.core.kernels import handles
from tandem.core.kernels.cpu.grouped_moe import (
    grouped_expert_kernel,
    grouped_fused_moe,
    grouped_routed_moe,
    one_call_entries,
)
from tandem.core.kernels.cpu.packed_experts import GroupedEntry, GroupedExpertKernel, PackedExperts
from tandem.core.kernels.reference.elementwise import GATED_ACTIVATIONS
from tandem.core.kernels.reference.fused_moe import sort_rows, spans_of
from tandem.core.layers.linear import _divide
from tandem.core.layers.weights import LazyTensor, copy_checked
from tandem.device.cpu import collapse_to_huge_pages, tensor_bytes

logger = logging.getLogger(__name__)


class RoutedExperts(nn.Module):
    """What every routed-experts module shares, float (``FusedMoeExperts``) or quantized
    (``quantized_moe.py``): every rank holds every expert, its slice of the intermediate
    dimension; ``forward(x, topk_weights, topk_ids)`` returns this rank's partial sums (the
    caller all-reduces them) unless ``partial_sums`` is False (every rank then holds the
    whole result)."""

    partial_sums = True

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
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.local_size = _divide(intermediate_size, group.size, "moe_intermediate_size")
        self.activation = activation

    def routed(
        self, x: torch.Tensor, logits: torch.Tensor, top_k: int, normalize: bool
    ) -> torch.Tensor | None:
        """``forward`` of the router's choice from its ``logits`` [T, E] (``TopKRouter``'s:
        top ``top_k`` of their softmax, renormalised where ``normalize``) where this module
        routes and computes in one call, the same result; None where it does not (the caller
        then routes and calls ``forward``)."""
        return None

    def load_checkpoint_tensor(self, suffix: str, loaded: LazyTensor, name: str) -> None:
        """``suffix``: the name after ``experts.`` (``3.up_proj.weight``, ``gate_up_proj``)."""
        raise NotImplementedError

    def fully_loaded(self) -> bool:
        """Whether every expert's every tensor was loaded."""
        raise NotImplementedError

    def loaded_parameters(self) -> list[str]:
        """Its parameters (relative names) the checkpoint fills."""
        return [name for name, _ in self.named_parameters()]

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


class FusedMoeExperts(RoutedExperts):
    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: str,
        group: ProcessGroup,
    ):
        super().__init__(num_experts, hidden_size, intermediate_size, activation, group)
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * self.local_size, hidden_size), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(num_experts, hidden_size, self.local_size), requires_grad=False
        )
        self._kernel = handles.fused_moe()
        # (expert or -1 for all, part) loaded so far: every expert must be covered.
        self._loaded: set[tuple[int, str]] = set()
        # Set by pack(): the grouped CPU kernel and both projections in its layout.
        self._grouped: tuple[GroupedExpertKernel, PackedExperts, PackedExperts] | None = None
        # Set by pack() where ``routed`` runs the layer in one native call.
        self._one_call: (
            tuple[tuple[PackedExperts, GroupedEntry], tuple[PackedExperts, GroupedEntry]] | None
        ) = None
        self._act = handles.gated_activation(activation)

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """This rank's partial sums (all-reduce them across ranks)."""
        grouped = self._grouped
        if grouped is not None:
            kernel, w13, w2 = grouped
            return grouped_fused_moe(
                x, kernel, w13, w2, topk_weights, topk_ids, self._act, self.activation
            )
        return self._kernel(x, self.w13, self.w2, topk_weights, topk_ids, self.activation)

    def routed(
        self, x: torch.Tensor, logits: torch.Tensor, top_k: int, normalize: bool
    ) -> torch.Tensor | None:
        """On the grouped CPU kernels: one native call (``grouped_routed_moe``)."""
        one_call = self._one_call
        if one_call is None:
            return None
        return grouped_routed_moe(x, logits, top_k, normalize, *one_call)

    def routed_inputs(
        self, x: torch.Tensor, topk_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What each expert's projections take, for calibration: the input rows of every
        (token, chosen expert) pair grouped by expert [T k, H], how many rows each expert has
        [E], and those rows' intermediate activations act(gate) * up [T k, I / tp], computed
        as ``forward`` computes them (the routing weights apply after the down projection)."""
        _, token, offsets = sort_rows(topk_ids, self.num_experts)
        rows = x.index_select(0, token)
        counts = offsets.diff()
        grouped = self._grouped
        if grouped is not None:
            kernel, w13, _ = grouped
            return rows, counts, self._act(kernel.grouped_matmul(rows, w13, offsets))
        gate_up = rows.new_empty(rows.shape[0], self.w13.shape[1])
        for expert, start, end in spans_of(offsets):
            gate_up[start:end] = rows[start:end] @ self.w13[expert].t()
        return rows, counts, GATED_ACTIVATIONS[self.activation](gate_up)

    def pack(self, kernel: GroupedExpertKernel) -> bool:
        """Pack both projections for ``kernel``'s grouped calls, in place of the plain
        weights (the parameters then hold the packed layout, so the model's size counts
        them once); False (nothing changed) where a shape does not fit its panels."""
        w13, w2 = kernel.pack_experts(self.w13.data), kernel.pack_experts(self.w2.data)
        if w13 is None or w2 is None:
            return False
        self._grouped = (kernel, w13, w2)
        self._one_call = one_call_entries(kernel, w13, w2, self.activation)
        self.w13.data, self.w2.data = w13.packed, w2.packed
        return True

    def load_checkpoint_tensor(self, suffix: str, loaded: LazyTensor, name: str) -> None:
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


def pack_expert_weights(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Pack the routed experts of a loaded CPU model for the grouped kernel of the one that
    serves its dense layers in ``dtype`` (AVX2 float32, AVX-512 float32, AVX512-BF16, AMX
    bfloat16); returns how many blocks."""
    kernel = grouped_expert_kernel(dtype) if device.type == "cpu" else None
    if kernel is None:
        return 0
    blocks = [m for m in model.modules() if isinstance(m, FusedMoeExperts) and m.pack(kernel)]
    if blocks:
        # Each decode step streams every active expert's weights once: on 4 KiB pages that is
        # a TLB miss every 4 KiB, as for the dense weights (packed_linear.py).
        moved = collapse_to_huge_pages(
            tensor_bytes(packed.packed)
            for block in blocks
            if block._grouped is not None
            for packed in block._grouped[1:]
        )
        logger.info("packed the routed experts of %d layers for grouped %s calls; %.0f MiB of "
                    "them on 2 MiB pages", len(blocks), kernel.name, moved / 2**20)  # fmt: skip
    return len(blocks)
