"""The torch reference of routed experts with quantized weights (W8A8 int8, W4A16 4-bit).

The (token, choice) rows are sorted by expert, as for float experts (``fused_moe.py``), and
each active expert's contiguous rows (a ``Span``) are multiplied with that expert's weight by
the dense quantized linear's own steps (``int8_linear.py``, ``int4_linear.py``): per-row int8
activations (each row's own absmax, or the expert's static scale), an exact int32 product,
the dequantize with the row's and the expert's per-channel scales; 4-bit weights dequantized
on the fly. So a quantized expert computes bit for bit what a dense quantized layer holding
its weight computes on the same rows, and the grouped steps below are each dense step over
every span.

The grouped steps take the experts' weights as anything indexed by expert: the stacked
tensors here, a CPU kernel's per-expert packed weights there (``cpu/quantized_moe.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tandem.core.kernels.reference import int4_linear as int4_ref
from tandem.core.kernels.reference import int8_linear as int8_ref
from tandem.core.kernels.reference.fused_moe import Span, sort_rows, spans_of


def sort_by_expert(
    topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, list[Span]]:
    """``sort_rows``, with each active expert's rows read on the host once, as the float
    reference reads its counts."""
    order, token, offsets = sort_rows(topk_ids, num_experts)
    return order, token, spans_of(offsets)


def _static(input_scales: torch.Tensor | None, expert: int) -> torch.Tensor | None:
    """An expert's static activation scale: the largest of its fused parts' (as vLLM reads
    a fused dense layer's), or None for per-token scales."""
    return None if input_scales is None else input_scales[expert].max()


def grouped_int8_linear(
    linear: Callable[..., torch.Tensor],
    rows: torch.Tensor,
    spans: Sequence[Span],
    weights: Any,
    weight_scales: torch.Tensor,
    input_scales: torch.Tensor | None,
) -> torch.Tensor:
    """Each span's rows through ``linear`` (``int8_linear``'s signature) with its expert's
    int8 weight ``weights[e]`` [N, K], scales ``weight_scales[e]`` [N, 1] and static scale
    (``input_scales`` [E, parts], or None: per-token) -> [M, N] in ``rows``' dtype."""
    out = rows.new_empty(rows.shape[0], weight_scales.shape[1])
    for expert, start, end in spans:
        out[start:end] = linear(
            rows[start:end],
            weights[expert],
            weight_scales[expert],
            _static(input_scales, expert),
            None,
        )
    return out


def grouped_int8_quantize(
    quantize: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    rows: torch.Tensor,
    spans: Sequence[Span],
    input_scales: torch.Tensor | None,
    absmax: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` [M, K] to int8 codes and each row's float32 scale [M, 1]: per token (from
    ``absmax`` [M, 1] where given: the rows' largest magnitude over every rank's columns),
    or with each span's expert's static scale."""
    if input_scales is None:
        return quantize(rows, None, absmax)
    q = torch.empty(rows.shape, dtype=torch.int8, device=rows.device)
    scale = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
    for expert, start, end in spans:
        q[start:end], scale[start:end] = quantize(
            rows[start:end], _static(input_scales, expert), None
        )
    return q, scale


def grouped_int8_matmul(
    matmul: Callable[..., torch.Tensor],
    q: torch.Tensor,
    spans: Sequence[Span],
    weights: Any,
    out_features: int,
) -> torch.Tensor:
    """Each span's int8 codes times its expert's int8 weight: exact int32 [M, N]."""
    out = torch.zeros(q.shape[0], out_features, dtype=torch.int32, device=q.device)
    for expert, start, end in spans:
        out[start:end] = matmul(q[start:end], weights[expert])
    return out


def grouped_int8_dequantize(
    dequantize: Callable[..., torch.Tensor],
    acc: torch.Tensor,
    scale: torch.Tensor,
    spans: Sequence[Span],
    weight_scales: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Each span's int32 sums times its rows' scales and its expert's channel scales."""
    out = torch.empty(acc.shape, dtype=dtype, device=acc.device)
    for expert, start, end in spans:
        out[start:end] = dequantize(
            acc[start:end], scale[start:end], weight_scales[expert], None, dtype
        )
    return out


def grouped_int4_linear(
    linear: Callable[..., torch.Tensor],
    rows: torch.Tensor,
    spans: Sequence[Span],
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor | None,
) -> torch.Tensor:
    """Each span's rows through ``linear`` (``int4_linear``'s signature) with its expert's
    packed codes [N, K / 8], scales and zero points [N, G] (and activation-order groups)."""
    out = rows.new_empty(rows.shape[0], scales.shape[1])
    for expert, start, end in spans:
        groups = None if g_idx is None else g_idx[expert]
        out[start:end] = linear(
            rows[start:end], codes[expert], scales[expert], zeros[expert], groups, None
        )
    return out


def grouped_reference(
    linear: Callable[..., torch.Tensor],
    rows: torch.Tensor,
    offsets: torch.Tensor,
    *weights: torch.Tensor,
) -> torch.Tensor:
    """``grouped_int4_linear`` of experts whose groups are consecutive inputs (``weights``:
    its codes, scales and zero points), the rows given by the routing's ``offsets`` [E + 1]
    (read on the host here: a native grouped kernel reads them where they lie)."""
    codes, scales, zeros = weights
    return grouped_int4_linear(linear, rows, spans_of(offsets), codes, scales, zeros, None)


# The reference steps, each with the handle signature (rows first).


def moe_int8_linear(
    rows: torch.Tensor,
    spans: Sequence[Span],
    weights: Any,
    weight_scales: torch.Tensor,
    input_scales: torch.Tensor | None,
) -> torch.Tensor:
    return grouped_int8_linear(
        int8_ref.int8_linear, rows, spans, weights, weight_scales, input_scales
    )


def moe_int8_quantize(
    rows: torch.Tensor,
    spans: Sequence[Span],
    input_scales: torch.Tensor | None,
    absmax: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return grouped_int8_quantize(int8_ref.quantize_int8, rows, spans, input_scales, absmax)


def moe_int8_matmul(
    q: torch.Tensor, spans: Sequence[Span], weights: Any, out_features: int
) -> torch.Tensor:
    return grouped_int8_matmul(int8_ref.int8_matmul, q, spans, weights, out_features)


def moe_int8_dequantize(
    acc: torch.Tensor,
    scale: torch.Tensor,
    spans: Sequence[Span],
    weight_scales: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    return grouped_int8_dequantize(int8_ref.dequantize, acc, scale, spans, weight_scales, dtype)


def moe_int4_linear(
    rows: torch.Tensor,
    spans: Sequence[Span],
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor | None,
) -> torch.Tensor:
    return grouped_int4_linear(int4_ref.int4_linear, rows, spans, codes, scales, zeros, g_idx)


# (rows, offsets, codes, scales, zeros): the grouped handle's signature.
moe_int4_grouped_linear = functools.partial(grouped_reference, int4_ref.int4_linear)
