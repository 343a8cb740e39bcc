"""An independent reader of GPTQ folders for tests: codes unpacked bit by bit (not through
``int4_packing``) and dequantized in float64 into a float folder the float model serves."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .checkpoint_files import read_tensors, rewrite_folder


def nibbles(words: torch.Tensor, dim: int) -> torch.Tensor:
    """Unpacked the slow way: entry 8c + i along ``dim`` from bits 4i..4i+3 of word c."""
    w = words.long() if dim == 1 else words.long().t()
    out = torch.zeros(w.shape[0], 8 * w.shape[1], dtype=torch.int64)
    for c in range(w.shape[1]):
        for i in range(8):
            out[:, 8 * c + i] = (w[:, c] >> (4 * i)) & 0xF
    return out if dim == 1 else out.t()


def dequantized_folder(src: Path, dst: Path) -> Path:
    """The float folder at ``dst`` whose weights are the GPTQ folder ``src``'s, dequantized."""
    tensors = read_tensors(src)
    config = json.loads((src / "config.json").read_text())
    sym = config.pop("quantization_config")["sym"]
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        base, _, kind = name.rpartition(".")
        if kind in ("qzeros", "scales", "g_idx"):
            continue
        if kind == "qweight":
            q = nibbles(t, dim=0).double()  # [K, N]
            g = tensors[f"{base}.g_idx"].long()
            scales = tensors[f"{base}.scales"].double()[g]  # [K, N]
            zeros = 8.0 if sym else nibbles(tensors[f"{base}.qzeros"], dim=1).double()[g] + 1
            out[f"{base}.weight"] = ((q - zeros) * scales).t().float().contiguous()
        else:
            out[name] = t
    return rewrite_folder(src, dst, out, config)
