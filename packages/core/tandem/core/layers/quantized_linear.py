"""The base of the parallel linear layers: float weights, or int8 weights with their scales
(W8A8, the compressed-tensors ``int-quantized`` layout vLLM reads).

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
from tandem.core.kernels.cpu.packed_linear import PackableLinear
from tandem.core.layers.quant_scheme import W8A8Scheme
from tandem.core.layers.weights import LazyTensor


class QuantizableLinear(PackableLinear):
    """``x W^T (+ b)`` with a float weight, or through the int8 kernel when built with a
    ``W8A8Scheme`` (``weight_scale`` is then set)."""

    # Registered by ``make_weight`` (None for a float layer).
    weight_scale: nn.Parameter | None
    input_scale: nn.Parameter | None

    def make_weight(
        self, rows: int, columns: int, quant: W8A8Scheme | None, input_sources: int = 1
    ) -> None:
        """Create ``weight`` [rows, columns] and, when quantized, its scales; the layer fuses
        ``input_sources`` checkpoint tensors (each with its own static input scale)."""
        self.register_parameter("weight_scale", None)
        self.register_parameter("input_scale", None)
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

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        weight_scale = self.weight_scale
        if weight_scale is None:
            return super().matmul(x, bias)
        static = self.input_scale.max() if self.input_scale is not None else None
        return self._int8_linear(x, self.weight, weight_scale, static, bias)

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
        acc = group.all_reduce(self._int8_matmul(q, self.weight))
        return self._int8_dequantize(acc, scale, self.weight_scale, bias, x.dtype)

    def load_input_scale(self, loaded: LazyTensor, slot: int, name: str) -> None:
        """A static per-tensor activation scale: one value, the same on every rank."""
        assert self.input_scale is not None
        shape = loaded.get_shape()
        if [d for d in shape if d != 1]:
            raise ValueError(
                f"checkpoint tensor {name} has shape {tuple(shape)}; a per-tensor input scale "
                "holds one value (the quantization_config says strategy 'tensor')"
            )
        value = loaded[tuple(slice(None) for _ in shape)]
        self.input_scale.data[slot] = value.reshape(())
