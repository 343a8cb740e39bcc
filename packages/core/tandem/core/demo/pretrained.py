"""The real pretrained model shipped inside the package: what `tandem serve` serves when no
model is named, and what tests check real text against."""

from __future__ import annotations

from pathlib import Path


def stories260k_folder() -> Path:
    """The bundled TinyStories Llama (260K parameters, MIT; see its README and LICENSE)."""
    return Path(__file__).resolve().parent / "stories260k"
