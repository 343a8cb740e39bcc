"""Routed experts with quantized weights, stacked per expert: int8 W8A8 (compressed-tensors,
as llm-compressor writes it) or 4-bit W4A16 (GPTQ, AWQ), in the layouts vLLM reads.

Checkpoint tensors are named per expert (``experts.{e}.gate_proj.weight`` int8 [I, H] with
``.weight_scale`` [I, 1] and, static, ``.input_scale``; or ``.qweight``, ``.qzeros``,
``.scales`` and, GPTQ, ``.g_idx``), each laid out as its dense projection's
(``quantized_linear.py``, ``int4_weights.py``). Held: ``w13`` (each expert's gate outputs,
then its up outputs) and ``w2`` (down), each parameter stacked along a leading expert axis.

Tensor parallelism, as float experts: every rank holds every expert and its slice of the
intermediate dimension, so ``w13`` is column-parallel (outputs split: packed words and the
per-channel scales with them) and ``w2`` row-parallel (inputs split: 4-bit groups with them,
so a group never straddles two ranks, unless every rank keeps every group: one group per
channel, or activation order), as vLLM shards its MoE weights.

Compute: the (token, choice) rows sorted by expert, each active expert's rows through the
dense quantized kernels (``kernels/reference/quantized_moe.py``; CPU: the native int8 and
4-bit kernels). int8 experts packed once at load for the CPU kernel run each projection as
one grouped call over every expert instead (the same roundings, bit for bit; the routing's
offsets read where they lie); so do 4-bit experts whose groups are consecutive inputs (the
CPU 4-bit library's grouped call: each expert's rows as its dense kernel runs them), while
4-bit experts in activation order keep the per-expert steps. 4-bit experts return
partial sums, reduced by the block as float experts'. int8 experts keep the dense
row-parallel contract (``QuantizableLinear.reduced_int8_matmul``): on more than one rank the
down projection's rows are quantized with scales every rank shares and the ranks sum exact
int32 products before dequantizing, so every rank holds the whole result, bit for bit what
one rank holding every expert whole computes; greedy tokens then never depend on the
topology.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from tandem.collectives import ProcessGroup, ReduceOp
from tandem.core.kernels import handles
from tandem.core.kernels.cpu.int8_gemm import NativeInt8, PackedInt8Experts, PackedInt8Weight
from tandem.core.kernels.reference.fused_moe import Span, combine, sort_rows, spans_of
from tandem.core.kernels.reference.int4_packing import PACK
from tandem.core.kernels.reference.quantized_moe import sort_by_expert
from tandem.core.layers.fused_moe import FusedMoeExperts, RoutedExperts
from tandem.core.layers.int4_weights import Int4Parameters, Split
from tandem.core.layers.quant_scheme import QuantScheme, W4A16Scheme, W8A8Scheme
from tandem.core.layers.weights import (
    LazyTensor,
    copy_channels,
    copy_checked,
    per_tensor_scale,
    read_shard,
)

logger = logging.getLogger(__name__)

# Checkpoint projection -> (our stacked projection, part of it).
_PARTS = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}
_ROWS = Split(dim=0, per_entry=1)
_COLUMNS = Split(dim=1, per_entry=1)


class ExpertProjection(nn.Module):
    """One projection of every routed expert, stacked: this rank's ``rows`` outputs and
    ``columns`` inputs (of ``full_columns``) per expert; ``parts`` checkpoint tensors fused
    along the outputs (gate and up); ``split_outputs``: column-parallel (else row-parallel).
    Its parameters are a dense layer's, with a leading expert axis."""

    def __init__(
        self,
        experts: int,
        rows: int,
        columns: int,
        full_columns: int,
        scheme: QuantScheme,
        parts: int,
        split_outputs: bool,
    ) -> None:
        super().__init__()
        self.parts = parts
        self.split_outputs = split_outputs
        self.int4: Int4Parameters | None = None
        # Every expert's int8 weight in the CPU int8 kernel's layout, where packed at load;
        # each expert's as a dense weight (views of it); each expert's static activation
        # scale (the largest of its fused parts', as the reference takes it).
        self.packed: PackedInt8Experts | None = None
        self.packed_experts: list[PackedInt8Weight] | None = None
        self.static_scales: torch.Tensor | None = None
        self.register_parameter("input_scale", None)
        if isinstance(scheme, W4A16Scheme):
            self.int4 = Int4Parameters(self, rows, columns, full_columns, scheme, experts)
            return
        self.weight = nn.Parameter(
            torch.empty(experts, rows, columns, dtype=torch.int8), requires_grad=False
        )
        self.weight_scale = nn.Parameter(torch.empty(experts, rows, 1), requires_grad=False)
        if scheme.static:
            self.input_scale = nn.Parameter(torch.empty(experts, parts), requires_grad=False)

    def split(self, param: nn.Parameter) -> Split | None:
        """Where ``param`` (one expert's entry) holds the dimension split across ranks:
        outputs (column-parallel) or inputs (row-parallel); None: the whole checkpoint tensor
        on every rank (per-channel scales of a row-parallel projection, 4-bit groups every
        rank keeps, a column-parallel ``g_idx``)."""
        if self.int4 is not None:
            int4 = self.int4
            return int4.output_split(param) if self.split_outputs else int4.input_split(param)
        if self.split_outputs:
            return _ROWS
        return _COLUMNS if param is self.weight else None

    def weights(self) -> Any:
        """The int8 weights, indexed by expert: packed where they were, else the plain ones."""
        return self.packed_experts if self.packed_experts is not None else self.weight

    def pack_int8(self, kernels: NativeInt8) -> bool:
        """Pack every expert's int8 weight for ``kernels`` in place of the plain one; False
        (nothing changed) for 4-bit experts or ones packed already."""
        if self.int4 is not None or self.packed is not None:
            return False
        weight = self.weight
        packed = kernels.pack_experts(weight.data)
        self.packed = packed
        self.packed_experts = [packed.expert(e) for e in range(packed.experts)]
        if self.input_scale is not None:
            self.static_scales = self.input_scale.detach().float().amax(dim=1).contiguous()
        weight.data = weight.data.new_empty((weight.shape[0], 0, weight.shape[2]))
        return True


class QuantizedMoeExperts(RoutedExperts):
    """Routed experts whose checkpoint is quantized with ``scheme`` (module docstring)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: str,
        group: ProcessGroup,
        scheme: QuantScheme,
    ):
        super().__init__(num_experts, hidden_size, intermediate_size, activation, group)
        self.scheme = scheme
        local = self.local_size
        if isinstance(scheme, W4A16Scheme) and local % PACK:
            raise ValueError(
                f"routed experts: moe_intermediate_size per tensor-parallel rank ({local}) is "
                f"not a multiple of {PACK}: 4-bit checkpoints pack {PACK} codes per int32 word "
                "along it; use fewer ranks"
            )
        try:
            self.w13 = ExpertProjection(
                num_experts, 2 * local, hidden_size, hidden_size, scheme, 2, split_outputs=True
            )
            self.w2 = ExpertProjection(
                num_experts, hidden_size, local, intermediate_size, scheme, 1, split_outputs=False
            )
        except ValueError as exc:
            raise ValueError(
                f"routed experts (moe_intermediate_size {intermediate_size} over "
                f"{group.size} tensor-parallel ranks): {exc}"
            ) from None
        # (expert, checkpoint projection, tensor) loaded so far.
        self._loaded: set[tuple[int, str, str]] = set()
        self._act = handles.gated_activation(activation)
        # Set by pack_int8: the native kernels whose grouped linear serves the int8 experts.
        self._int8: NativeInt8 | None = None
        if isinstance(scheme, W8A8Scheme):
            self._linear = handles.moe_int8_linear()
            self._quantize = handles.moe_int8_quantize()
            self._matmul = handles.moe_int8_matmul()
            self._dequantize = handles.moe_int8_dequantize()
            # Row-parallel int8 down projections reduce exact int32 sums themselves.
            self.partial_sums = group.size == 1
        else:
            self._int4_linear = handles.moe_int4_linear()
            self._int4_grouped = handles.moe_int4_grouped_linear()

    # Loading.

    def load_checkpoint_tensor(self, suffix: str, loaded: LazyTensor, name: str) -> None:
        shape = loaded.get_shape()
        parsed = suffix.split(".")
        if len(parsed) != 3 or not parsed[0].isdigit() or parsed[1] not in _PARTS:
            raise ValueError(
                f"checkpoint tensor {name} is no expert tensor of this quantized checkpoint: "
                "quantized experts are stored one by one (experts.{e}.gate_proj.*, up_proj, "
                "down_proj), not stacked"
            )
        expert, checkpoint_projection, tensor = int(parsed[0]), parsed[1], parsed[2]
        self._check(0 <= expert < self.num_experts, name, shape)
        which, part = _PARTS[checkpoint_projection]
        projection: ExpertProjection = getattr(self, which)
        param = projection._parameters.get(tensor)
        if param is None:
            expected = ", ".join(
                sorted(n for n, p in projection._parameters.items() if p is not None)
            )
            raise ValueError(
                f"checkpoint tensor {name} is not a tensor of an expert quantized as "
                f"config.json's quantization_config says (expected {expected})"
            )
        if param is projection.input_scale:
            param.data[expert, part] = per_tensor_scale(loaded, name)
        elif projection.split_outputs:
            self._load_outputs(projection, param, expert, part, loaded, name)
        else:
            self._load_inputs(projection, param, expert, loaded, name)
        self._loaded.add((expert, checkpoint_projection, tensor))

    def _extent(self, loaded: LazyTensor, split: Split, name: str) -> None:
        """The checkpoint tensor must span the whole intermediate size along ``split``."""
        shape = loaded.get_shape()
        if split.dim >= len(shape) or shape[split.dim] * split.per_entry != self.intermediate_size:
            raise ValueError(
                f"checkpoint tensor {name} (shape {tuple(shape)}) does not fit experts of "
                f"moe_intermediate_size {self.intermediate_size}; the config.json does not "
                "match the weights"
            )

    def _load_outputs(
        self,
        projection: ExpertProjection,
        param: nn.Parameter,
        expert: int,
        part: int,
        loaded: LazyTensor,
        name: str,
    ) -> None:
        """Gate or up: this rank's outputs into part ``part`` of the expert's fused outputs."""
        held = param.data[expert]
        split = projection.split(param)
        if split is None:  # g_idx: inputs only, one per fused part
            assert projection.int4 is not None
            src = loaded[tuple(slice(None) for _ in loaded.get_shape())]
            if not projection.int4.check_shared_g_idx(src, name, expert):
                copy_checked(held, src, name)
            return
        self._extent(loaded, split, name)
        size = self.local_size
        start, offset = self.group.rank * size, part * size
        copy_channels(held, loaded, split.dim, split.per_entry, start, size, name, offset)

    def _load_inputs(
        self,
        projection: ExpertProjection,
        param: nn.Parameter,
        expert: int,
        loaded: LazyTensor,
        name: str,
    ) -> None:
        """Down: this rank's inputs (or the whole tensor, where every rank keeps it)."""
        held = param.data[expert]
        split = projection.split(param)
        if split is None:
            copy_checked(held, read_shard(loaded, 0, 0, loaded.get_shape()[0]), name)
            return
        self._extent(loaded, split, name)
        size = self.local_size
        copy_channels(
            held, loaded, split.dim, split.per_entry, self.group.rank * size, size, name,
            what="inputs", unit="entries (packed words or quantization groups)",
        )  # fmt: skip

    def fully_loaded(self) -> bool:
        for checkpoint_projection, (which, _) in _PARTS.items():
            projection: ExpertProjection = getattr(self, which)
            tensors = [n for n, p in projection._parameters.items() if p is not None]
            for e in range(self.num_experts):
                if any((e, checkpoint_projection, t) not in self._loaded for t in tensors):
                    return False
        return True

    def finish_loading(self, name: str) -> None:
        """Repack 4-bit experts into the kernel's layout (once; nothing for int8)."""
        for which in ("w13", "w2"):
            projection: ExpertProjection = getattr(self, which)
            if projection.int4 is not None:
                projection.int4.finish_loading(f"{name}.{which}")

    def pack_int8(self, kernels: NativeInt8) -> int:
        """Pack each projection's int8 weights for the CPU kernel, in place of the plain ones
        (one grouped call per projection then serves every expert); how many projections were
        packed (none for 4-bit experts or ones packed already)."""
        packed = sum(projection.pack_int8(kernels) for projection in (self.w13, self.w2))
        if self.w13.packed is not None and self.w2.packed is not None:
            self._int8 = kernels
        return packed

    def packed_bytes(self) -> int:
        """Bytes of the int8 weights packed for the CPU kernel (beside the parameters)."""
        return sum(p.nbytes for p in (self.w13.packed, self.w2.packed) if p is not None)

    # Compute.

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """This rank's partial sums (``partial_sums``), or the whole result."""
        if self._int8 is not None:
            return self._grouped_int8(self._int8, x, topk_weights, topk_ids)
        a, b = self.w13.int4, self.w2.int4
        if a is not None and b is not None:
            return self._int4(a, b, x, topk_weights, topk_ids)
        order, token, spans = sort_by_expert(topk_ids, self.num_experts)
        rows = x.index_select(0, token)
        w13, w2 = self.w13, self.w2
        hidden = self._act(
            self._linear(rows, spans, w13.weights(), w13.weight_scale, w13.input_scale)
        )
        if self.group.size == 1:
            out = self._linear(hidden, spans, w2.weights(), w2.weight_scale, w2.input_scale)
        else:
            out = self._reduced_down(hidden, spans)
        return combine(x, out, order, token, topk_weights)

    def _int4(
        self,
        a: Int4Parameters,
        b: Int4Parameters,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """4-bit experts (``a`` gate/up, ``b`` down). Groups of consecutive inputs: each
        projection one grouped call over every expert, the routing's offsets read where
        they lie (the CPU kernel; the reference reads them on the host). Activation order
        (each expert its own ``g_idx``, which the grouped kernel does not take): the
        per-expert steps, the spans read on the host once."""
        a_groups, b_groups = a.kernel_g_idx(), b.kernel_g_idx()
        if a_groups is None and b_groups is None:
            order, token, offsets = sort_rows(topk_ids, self.num_experts)
            rows = x.index_select(0, token)
            hidden = self._act(self._int4_grouped(rows, offsets, a.qweight, a.scales, a.qzeros))
            out = self._int4_grouped(hidden, offsets, b.qweight, b.scales, b.qzeros)
            return combine(x, out, order, token, topk_weights)
        order, token, spans = sort_by_expert(topk_ids, self.num_experts)
        rows = x.index_select(0, token)
        hidden = self._act(self._int4_linear(rows, spans, a.qweight, a.scales, a.qzeros, a_groups))
        out = self._int4_linear(hidden, spans, b.qweight, b.scales, b.qzeros, b_groups)
        return combine(x, out, order, token, topk_weights)

    def _grouped_int8(
        self,
        kernels: NativeInt8,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """The int8 experts packed for ``kernels``: each projection one grouped call over
        every expert, bit for bit the per-expert steps (each row quantized, multiplied and
        dequantized as there); the routing's offsets are read where they lie, except by a
        row-parallel down projection (more than one rank), whose steps take the spans."""
        w13, w2 = self.w13, self.w2
        assert w13.packed is not None and w2.packed is not None
        order, token, offsets = sort_rows(topk_ids, self.num_experts)
        rows = x.index_select(0, token)
        up = kernels.grouped_linear(rows, w13.packed, offsets, w13.weight_scale, w13.static_scales)
        hidden = self._act(up)
        if self.group.size == 1:
            out = kernels.grouped_linear(
                hidden, w2.packed, offsets, w2.weight_scale, w2.static_scales
            )
        else:
            out = self._reduced_down(hidden, spans_of(offsets))
        return combine(x, out, order, token, topk_weights)

    def _reduced_down(self, hidden: torch.Tensor, spans: list[Span]) -> torch.Tensor:
        """The row-parallel int8 down projection, the whole result on every rank: each row
        quantized as one rank holding its every input would (static: the expert's scale;
        dynamic: the row's absmax over every rank's inputs), the exact int32 products summed
        across ranks, then dequantized."""
        w2, group = self.w2, self.group
        absmax = None
        if w2.input_scale is None:
            absmax = group.all_reduce(hidden.float().abs().amax(dim=-1, keepdim=True), ReduceOp.MAX)
        q, scale = self._quantize(hidden, spans, w2.input_scale, absmax)
        acc = group.all_reduce(self._matmul(q, spans, w2.weights(), self.hidden_size))
        return self._dequantize(acc, scale, spans, w2.weight_scale, hidden.dtype)


def routed_experts(
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    activation: str,
    group: ProcessGroup,
    scheme: QuantScheme | None,
) -> RoutedExperts:
    """Float experts, or quantized ones for a checkpoint that quantizes them (``scheme``)."""
    if scheme is None:
        return FusedMoeExperts(num_experts, hidden_size, intermediate_size, activation, group)
    return QuantizedMoeExperts(
        num_experts, hidden_size, intermediate_size, activation, group, scheme
    )
