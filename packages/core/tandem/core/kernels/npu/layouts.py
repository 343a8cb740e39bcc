"""The load-time layouts of the quantized weights torch_npu's matmuls read, made once per layer
after loading (``layers/npu_packing.py``), as vllm-ascend's ``process_weights_after_loading``
makes them (``quantization/methods/w8a8_dynamic.py``, ``w8a16.py``, ``w4a16.py``).

- int8 (W8A8): the weight stays the checkpoint's [N, K] and reaches ``npu_quant_matmul`` as
  its transposed view, which the op takes as x2 (vllm-ascend copies it to [K, N] for the NZ
  format, which the engine does not use); the per-channel scale becomes the op's 1-D float32
  (N,), the one scale dtype it takes for float16 and bfloat16 outputs alike.
- 4-bit (W4A16): the codes signed (code - 8) and packed by ``npu_convert_weight_to_int4pack``
  into [K, N / 8]; the scales [G, N] in the model's dtype; the zero points as the op's
  ``antiquant_offset`` = 8 - zero, so that ``(w + offset) * scale`` is the checkpoint's
  ``(code - zero) * scale``, or none where every zero point is 8 (symmetric).

torch_npu is imported only when a layout is made (the NPU runtime has imported it by then).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from tandem.core.kernels.reference.int4_packing import unpack_int4

# Codes 0..15 centred on 8 become the op's int4 values -8..7.
_CODE_CENTRE = 8
# npu_weight_quant_batchmatmul's limits: K and N at most this, and a per-group size a
# multiple of 32 in [32, K - 1] (its op-plugin page).
MAX_DIM = 65535
GROUP_QUANTUM = 32
PER_CHANNEL = 0


@dataclass(frozen=True)
class NpuInt4Weight:
    """A 4-bit layer's weight as ``npu_weight_quant_batchmatmul`` reads it."""

    packed: torch.Tensor  # int32 [K, N / 8]
    scale: torch.Tensor  # [G, N], the model's dtype
    offset: torch.Tensor | None  # [G, N], the model's dtype; None: all zero
    group_size: int  # inputs per group; 0 (PER_CHANNEL): one group of all K

    @property
    def outputs(self) -> int:
        return int(self.scale.shape[1])

    @property
    def nbytes(self) -> int:
        parts = (self.packed, self.scale, self.offset)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


def int8_scale_layout(weight_scale: torch.Tensor) -> torch.Tensor:
    """A W8A8 layer's per-channel scale [N, 1] as ``npu_quant_matmul``'s (N,) float32."""
    return weight_scale.detach().float().reshape(-1).contiguous()


def int4_group_size(inputs: int, groups: int) -> int | None:
    """The ``antiquant_group_size`` of ``groups`` groups over ``inputs`` (PER_CHANNEL for one
    group), or None where the op cannot take it."""
    if groups == 1:
        return PER_CHANNEL
    size = inputs // groups
    if size * groups != inputs or size % GROUP_QUANTUM or not GROUP_QUANTUM <= size < inputs:
        return None
    return size


def int4_unsupported(codes: torch.Tensor, scales: torch.Tensor) -> str | None:
    """Why ``npu_weight_quant_batchmatmul`` cannot serve a layer packed [N, K / 8] with
    ``scales`` [N, G] (None where it can)."""
    outputs, inputs = codes.shape[0], codes.shape[1] * 8
    if max(outputs, inputs) > MAX_DIM:
        return f"its {inputs} inputs or {outputs} outputs exceed the op's {MAX_DIM}"
    if int4_group_size(inputs, scales.shape[1]) is None:
        return (
            f"its groups of {inputs // scales.shape[1]} inputs are not a multiple of "
            f"{GROUP_QUANTUM} below its {inputs} inputs"
        )
    return None


def npu_int4_layout(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype
) -> NpuInt4Weight:
    """The op's layout of a layer held in the CPU kernels' layout (``layers/int4_weights.py``:
    ``codes`` int32 [N, K / 8], ``scales`` [N, G], ``zeros`` uint8 [N, G]); the caller has
    checked ``int4_unsupported``."""
    torch_npu = importlib.import_module("torch_npu")
    signed = unpack_int4(codes, dim=1).to(torch.int32) - _CODE_CENTRE
    packed: torch.Tensor = torch_npu.npu_convert_weight_to_int4pack(signed.t().contiguous())
    offset = (_CODE_CENTRE - zeros.to(torch.int32)).t().contiguous()
    group_size = int4_group_size(signed.shape[1], scales.shape[1])
    assert group_size is not None
    return NpuInt4Weight(
        packed=packed,
        scale=scales.t().to(dtype).contiguous(),
        offset=offset.to(dtype) if bool(offset.any()) else None,
        group_size=group_size,
    )
