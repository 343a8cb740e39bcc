"""Reading a one-file checkpoint's tensors and writing a changed copy of its folder, for the
tests that derive folders from folders (quantized, dequantized, reordered)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def rewrite_folder(
    src: Path, dst: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]
) -> Path:
    """A copy of ``src`` at ``dst`` with these tensors and this ``config.json``."""
    shutil.copytree(src, dst)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return dst
