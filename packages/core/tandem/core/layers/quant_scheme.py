"""How a checkpoint's linear layers are quantized, as the layers are built with it (parsed from
``config.json`` by ``models/quantization_config.py``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class W8A8Scheme:
    """int8 symmetric weights with one scale per output channel; activations int8 symmetric,
    per token at run time (``static`` False) or with a calibrated per-tensor ``input_scale``
    (True)."""

    static: bool
