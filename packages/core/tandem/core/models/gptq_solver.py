"""GPTQ (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers"): each linear layer's weight quantized one input column at a time,
the error of each column spread over the columns not yet quantized so that the layer's
outputs on calibration activations X move as little as possible (second-order, through the
Hessian H = 2 X^T X of the squared output error).

The procedure is the paper's Algorithm 1 as the reference implementation runs it
(IST-DASLab/gptq ``gptq.py``, ``fasterquant``), which AutoGPTQ keeps:

- inputs that never saw a non-zero activation (diag(H) = 0) get H_jj = 1 and weight 0;
- dampening: H += damp * mean(diag(H)) * I (``damp_percent``, 0.01);
- optional activation order: columns quantized in decreasing diag(H) (``desc_act``); each
  input's group is then its place in that order divided by the group size (``g_idx``);
- the upper Cholesky factor U of H^-1; in blocks of 128 columns, column j is quantized, its
  error e = (w_j - q_j) / U_jj is subtracted from the block's later columns times U_j,(j+1:),
  and the block's errors from all later columns at the block's end (lazy batch updates);
- a group's scale and zero point are chosen when quantization reaches its first column, from
  the group's weights as the updates left them (``static_groups`` false), with the
  round-to-nearest quantizer (``quantize_gptq``, what ``tandem quantize`` uses uncalibrated).

Everything runs in float64 on the CPU: the writer is offline, and GPTQ's updates are
ill-conditioned enough that float32 Cholesky factorizations fail on real Hessians.
"""

from __future__ import annotations

import torch

_BLOCK = 128
_MAX_CODE = 15
_SYMMETRIC_ZERO = 8
# The smallest zero point AutoGPTQ's format can store (it stores each minus one).
_STORED_ZERO_OFFSET = 1
_SCALE_DTYPE = torch.float16


def quantize_gptq(
    weight: torch.Tensor, group_size: int, sym: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] -> (codes uint8 [N, K], zero points uint8 [N, G], float16 scales
    [N, G]) with weight ~ (code - zero) * scale of the input's group."""
    rows, columns = weight.shape
    size = columns if group_size == -1 else group_size
    w = weight.double().view(rows, columns // size, size)
    low = w.amin(-1).clamp(max=0)
    high = w.amax(-1).clamp(min=0)
    if sym:
        high = torch.maximum(-low, high)
        low = -high
    # An all-zero group: GPTQ's quantizer widens it to [-1, 1].
    empty = (low == 0) & (high == 0)
    low, high = low.masked_fill(empty, -1), high.masked_fill(empty, 1)
    tiny = torch.finfo(_SCALE_DTYPE).tiny
    scales = ((high - low) / _MAX_CODE).clamp(min=tiny).to(_SCALE_DTYPE)
    s = scales.double()
    if sym:
        zeros = torch.full_like(s, _SYMMETRIC_ZERO)
    else:
        zeros = torch.round(-low / s).clamp(_STORED_ZERO_OFFSET, _MAX_CODE)
    codes = torch.round(w / s.unsqueeze(-1)) + zeros.unsqueeze(-1)
    codes = codes.clamp(0, _MAX_CODE).view(rows, columns)
    return codes.to(torch.uint8), zeros.to(torch.uint8), scales


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    group_size: int,
    sym: bool,
    act_order: bool = False,
    damp: float = 0.01,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` [N, K], ``hessian`` [K, K] (sum of x x^T over the calibration tokens, any
    positive scale) -> (codes uint8 [N, K] in input order, zero points uint8 [N, G], float16
    scales [N, G], g_idx int32 [K]), with weight ~ (code - zero) * scale of the input's group.
    """
    rows, columns = weight.shape
    size = columns if group_size == -1 else group_size
    if columns % size:
        raise ValueError(f"{columns} inputs are not whole groups of {size}")
    w = weight.double().clone()
    h = hessian.double().clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    perm = torch.argsort(torch.diagonal(h), descending=True) if act_order else None
    if perm is not None:
        w, h = w[:, perm], h[perm][:, perm]
    h += damp * torch.diagonal(h).mean() * torch.eye(columns, dtype=h.dtype)
    upper = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    groups = columns // size
    codes = torch.zeros(rows, columns, dtype=torch.uint8)
    zeros = torch.zeros(rows, groups, dtype=torch.uint8)
    scales = torch.zeros(rows, groups, dtype=torch.float16)
    scale = zero = torch.zeros(rows, dtype=torch.float64)
    for start in range(0, columns, _BLOCK):
        end = min(start + _BLOCK, columns)
        block = w[:, start:end].clone()
        errors = torch.zeros_like(block)
        for i in range(end - start):
            column = start + i
            if column % size == 0:
                # The group's parameters from its weights as updated so far (within this block
                # for the columns here, as ``w`` holds them for the columns past it).
                group = torch.cat([block[:, i:], w[:, end:]], dim=1)[:, :size]
                _, z, s = quantize_gptq(group, -1, sym)
                g = column // size
                zeros[:, g], scales[:, g] = z[:, 0], s[:, 0]
                zero, scale = z[:, 0].double(), s[:, 0].double()
            q = (torch.round(block[:, i] / scale) + zero).clamp(0, 15)
            codes[:, column] = q.to(torch.uint8)
            error = (block[:, i] - (q - zero) * scale) / upper[column, column]
            block[:, i:] -= error.unsqueeze(1) * upper[column, column:end].unsqueeze(0)
            errors[:, i] = error
        w[:, end:] -= errors @ upper[start:end, end:]
    g_idx = torch.arange(columns, dtype=torch.int32) // size
    if perm is not None:
        inverse = torch.argsort(perm)
        codes, g_idx = codes[:, inverse], g_idx[inverse]
    return codes, zeros, scales, g_idx
