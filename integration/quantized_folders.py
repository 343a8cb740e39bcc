"""Quantized model folders derived from the ones ``tandem quantize`` writes, in the layouts it
does not write: W8A8 with static (calibrated per-tensor) activation scales, and AutoAWQ's GEMM
layout of an asymmetric 4-bit model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.core.kernels.reference.int4_packing import AWQ_ORDER, pack_int4, unpack_int4

_WEIGHTS = "model.safetensors"
# AutoGPTQ stores each zero point minus one; AutoAWQ stores it as it is.
_GPTQ_ZERO_OFFSET = 1


def _read(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / _WEIGHTS), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def _rewrite(
    src: Path, dst: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]
) -> Path:
    shutil.copytree(src, dst)
    save_file(tensors, str(dst / _WEIGHTS), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return dst


def _config(folder: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((folder / "config.json").read_text())
    return config


def static_w8a8(w8a8: Path, dst: Path, scale: float) -> Path:
    """A dynamic W8A8 folder with one calibrated activation scale for every projection."""
    tensors = _read(w8a8)
    for name in [n for n, t in tensors.items() if t.dtype is torch.int8]:
        tensors[name.removesuffix("weight") + "input_scale"] = torch.tensor([scale])
    config = _config(w8a8)
    group = config["quantization_config"]["config_groups"]["group_0"]
    group["input_activations"].update(dynamic=False, strategy="tensor", observer="minmax")
    return _rewrite(w8a8, dst, tensors, config)


def awq_from_gptq(gptq: Path, dst: Path, group_size: int) -> Path:
    """An asymmetric GPTQ folder's weights in AutoAWQ's GEMM layout: codes and zero points
    packed along the outputs in AWQ's nibble order, zero points as they are, no g_idx."""
    out: dict[str, torch.Tensor] = {}
    for name, t in _read(gptq).items():
        kind = name.rpartition(".")[2]
        if kind == "qweight":
            out[name] = pack_int4(unpack_int4(t, dim=0), dim=1, order=AWQ_ORDER)
        elif kind == "qzeros":
            zeros = unpack_int4(t, dim=1).long() + _GPTQ_ZERO_OFFSET
            out[name] = pack_int4(zeros, dim=1, order=AWQ_ORDER)
        elif kind != "g_idx":
            out[name] = t
    config = _config(gptq)
    config["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    return _rewrite(gptq, dst, out, config)
