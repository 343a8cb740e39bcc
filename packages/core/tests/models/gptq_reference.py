"""An independent reader of 4-bit folders (GPTQ and AWQ) for tests: codes unpacked bit by bit
(not through ``int4_packing``) and dequantized in float64 into a float folder the float model
serves."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .checkpoint_files import read_tensors, rewrite_folder

# AutoAWQ's ``order_map``: nibble p of a word holds code AWQ_NIBBLES[p] of its run of eight.
AWQ_NIBBLES = (0, 2, 4, 6, 1, 3, 5, 7)


def nibbles(
    words: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))
) -> torch.Tensor:
    """Unpacked the slow way: entry 8c + order[p] along ``dim`` from bits 4p..4p+3 of word c."""
    w = words.long() if dim == 1 else words.long().t()
    out = torch.zeros(w.shape[0], 8 * w.shape[1], dtype=torch.int64)
    for c in range(w.shape[1]):
        for p in range(8):
            out[:, 8 * c + order[p]] = (w[:, c] >> (4 * p)) & 0xF
    return out if dim == 1 else out.t()


def _codes_zeros_groups(
    tensors: dict[str, torch.Tensor], base: str, qc: dict[str, object]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [K, N], zero points [G, N], each input's group [K]) of one layer."""
    if qc["quant_method"] == "awq":
        codes = nibbles(tensors[f"{base}.qweight"], dim=1, order=AWQ_NIBBLES)
        zeros = nibbles(tensors[f"{base}.qzeros"], dim=1, order=AWQ_NIBBLES)
        groups = torch.arange(codes.shape[0]) * zeros.shape[0] // codes.shape[0]
        return codes, zeros, groups
    codes = nibbles(tensors[f"{base}.qweight"], dim=0)
    groups = tensors[f"{base}.g_idx"].long()
    if qc["sym"]:
        return codes, torch.full_like(tensors[f"{base}.scales"], 8, dtype=torch.int64), groups
    # GPTQ's v1 format stores each zero point minus one.
    return codes, nibbles(tensors[f"{base}.qzeros"], dim=1) + 1, groups


def dequantized_folder(src: Path, dst: Path) -> Path:
    """The float folder at ``dst`` whose weights are the 4-bit folder ``src``'s, dequantized."""
    tensors = read_tensors(src)
    config = json.loads((src / "config.json").read_text())
    qc = config.pop("quantization_config")
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        base, _, kind = name.rpartition(".")
        if kind in ("qzeros", "scales", "g_idx"):
            continue
        if kind == "qweight":
            codes, zeros, groups = _codes_zeros_groups(tensors, base, qc)
            scales = tensors[f"{base}.scales"].double()[groups]  # [K, N]
            w = (codes.double() - zeros.double()[groups]) * scales
            out[f"{base}.weight"] = w.t().float().contiguous()
        else:
            out[name] = t
    return rewrite_folder(src, dst, out, config)
