"""The base of the parallel linear layers: float weights, int8 weights with their scales
(W8A8, the compressed-tensors ``int-quantized`` layout vLLM reads), or 4-bit GPTQ weights
(W4A16: ``qweight``, ``qzeros``, ``scales``, ``g_idx``; ``int4_weights.py`` says how they are
laid out, sharded and packed).

A quantized layer holds, beside ``weight`` (int8 [out, in], this rank's shard),
``weight_scale`` ([out, 1], one per output channel: split with the output rows, whole where
the weight is split by input columns) and, for static activations, ``input_scale``: one per
checkpoint tensor the layer fuses (q, k, v), applied as their maximum, as vLLM does, so no
part's activations saturate earlier than they were calibrated to.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.collectives import ProcessGroup, ReduceOp
from tandem.core.kernels import handles
from tandem.core.kernels.cpu.int8_gemm import PackedInt8Weight
from tandem.core.kernels.cpu.packed_linear import PackableLinear
from tandem.core.layers.int4_weights import Int4Parameters, Split
from tandem.core.layers.quant_scheme import QuantScheme, W4A16Scheme
from tandem.core.layers.weights import (
    LazyTensor,
    copy_channels,
    copy_checked,
    per_tensor_scale,
)

# A float or int8 weight [out, in], and what is cut along its outputs alone.
_WEIGHT_OUTPUTS = Split(dim=0, per_entry=1)
_WEIGHT_INPUTS = Split(dim=1, per_entry=1)


class QuantizableLinear(PackableLinear):
    """``x W^T (+ b)`` with a float weight, through the int8 kernel when built with a
    ``W8A8Scheme`` (``weight_scale`` is then set), or the 4-bit one with a ``W4A16Scheme``
    (``int4`` is then set, and there is no ``weight``)."""

    # Registered by ``make_weight`` (None for a float layer).
    weight_scale: nn.Parameter | None
    input_scale: nn.Parameter | None
    int4: Int4Parameters | None = None
    # The int8 weight in the CPU int8 kernel's layout, where it was packed at load
    # (``int8_packing``); ``weight`` is then empty.
    int8_packed: PackedInt8Weight | None = None

    def make_weight(
        self,
        rows: int,
        columns: int,
        quant: QuantScheme | None,
        input_sources: int = 1,
        full_columns: int | None = None,
    ) -> None:
        """Create ``weight`` [rows, columns] and, when quantized, its scales; the layer fuses
        ``input_sources`` checkpoint tensors (each with its own static input scale).
        ``full_columns``: the unsharded input size, where this rank holds some of the inputs."""
        self.register_parameter("weight_scale", None)
        self.register_parameter("input_scale", None)
        if isinstance(quant, W4A16Scheme):
            self.register_parameter("weight", None)
            self.int4 = Int4Parameters(self, rows, columns, full_columns or columns, quant)
            self._int4_linear = handles.int4_linear()
            return
        if quant is None:
            self.weight = nn.Parameter(torch.empty(rows, columns), requires_grad=False)
            return
        self.weight = nn.Parameter(
            torch.empty(rows, columns, dtype=torch.int8), requires_grad=False
        )
        self.weight_scale = nn.Parameter(torch.empty(rows, 1), requires_grad=False)
        if quant.static:
            self.input_scale = nn.Parameter(torch.empty(input_sources), requires_grad=False)
        self._int8_linear = handles.int8_linear()
        self._int8_quantize = handles.int8_quantize()
        self._int8_matmul = handles.int8_matmul()
        self._int8_dequantize = handles.int8_dequantize()

    def output_split(self, param: nn.Parameter) -> Split | None:
        """Where ``param`` holds this layer's output channels (None: it has no output axis)."""
        if self.int4 is not None and self.int4.owns(param):
            return self.int4.output_split(param)
        return _WEIGHT_OUTPUTS

    def input_split(self, param: nn.Parameter) -> Split | None:
        """Where ``param`` holds input channels (None: every rank loads it whole)."""
        if self.int4 is not None and self.int4.owns(param):
            return self.int4.input_split(param)
        return _WEIGHT_INPUTS if param is self.weight else None

    def load_output_rows(
        self,
        param: nn.Parameter,
        loaded: LazyTensor,
        name: str,
        start: int,
        size: int,
        offset: int = 0,
    ) -> None:
        """Outputs ``[start, start + size)`` of the checkpoint tensor into this rank's outputs
        from ``offset`` (a fused part's place), along whichever axis ``param`` keeps them."""
        split = self.output_split(param)
        if split is None:  # g_idx: inputs only, one per fused part
            assert self.int4 is not None
            src = loaded[tuple(slice(None) for _ in loaded.get_shape())]
            if self.int4.check_shared_g_idx(src, name):
                return
            copy_checked(param.data, src, name)
            return
        copy_channels(param.data, loaded, split.dim, split.per_entry, start, size, name, offset)

    def finish_loading(self, name: str) -> None:
        """Repack loaded 4-bit weights into the kernel's layout (nothing for other layers)."""
        if self.int4 is not None:
            self.int4.finish_loading(name)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.int4 is not None:
            w = self.int4
            order = w.input_order()
            if order is not None:
                x = x.index_select(-1, order)
            g_idx = w.kernel_g_idx()
            codes = w.qweight if w.npu is None else w.npu
            return self._int4_linear(x, codes, w.scales, w.qzeros, g_idx, bias)
        weight_scale = self.weight_scale
        if weight_scale is None:
            return super().matmul(x, bias)
        static = self.input_scale.max() if self.input_scale is not None else None
        return self._int8_linear(x, self._int8_weight(), weight_scale, static, bias)

    def _int8_weight(self) -> torch.Tensor | PackedInt8Weight:
        return self.weight if self.int8_packed is None else self.int8_packed

    def reduced_int8_matmul(
        self, x: torch.Tensor, bias: torch.Tensor | None, group: ProcessGroup
    ) -> torch.Tensor:
        """``x W^T (+ b)`` where each rank of ``group`` holds some of the input columns: all
        ranks quantize with the same scales (static, or each token's absmax over every rank's
        columns) and sum their exact int32 products before scaling, so the result is bit for
        bit the unsharded layer's (vLLM scales per rank instead; then greedy tokens differ
        between topologies)."""
        assert self.weight_scale is not None
        static = self.input_scale.max() if self.input_scale is not None else None
        absmax = None
        if static is None:
            absmax = group.all_reduce(x.float().abs().amax(dim=-1, keepdim=True), ReduceOp.MAX)
        q, scale = self._int8_quantize(x, static, absmax)
        acc = group.all_reduce(self._int8_matmul(q, self._int8_weight()))
        return self._int8_dequantize(acc, scale, self.weight_scale, bias, x.dtype)

    def load_input_scale(self, loaded: LazyTensor, slot: int, name: str) -> None:
        """A static per-tensor activation scale: one value, the same on every rank."""
        assert self.input_scale is not None
        self.input_scale.data[slot] = per_tensor_scale(loaded, name)
