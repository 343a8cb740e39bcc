"""Read a Hugging Face ``config.json`` into the config its architecture needs: the model class
the registry serves the architecture with declares its parser (``parse_config``), so a new
architecture brings its own and nothing here names it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from tandem.core.errors import ModelLoadError
from tandem.core.models.model_config import ModelConfig
from tandem.core.models.quantization_config import parse_quantization
from tandem.core.models.registry import model_class


def parse_model_config(raw: dict[str, Any]) -> ModelConfig:
    """The config that the parsed ``config.json`` ``raw`` describes."""
    archs = raw.get("architectures") or []
    if not archs:
        raise ModelLoadError("config.json has no 'architectures' entry")
    arch = str(archs[0])
    cls = model_class(arch)
    try:
        config = cls.parse_config(raw, arch)
    except KeyError as exc:
        raise ModelLoadError(f"config.json lacks the required field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"config.json has a malformed field: {exc}") from None
    layout = cls.decoder_layout(config)
    quantization = parse_quantization(raw, arch, cls.SERVES_W8A8, layout)
    return config if quantization is None else replace(config, quantization=quantization)


def load_model_config(folder: Path) -> ModelConfig:
    """The config of the Hugging Face model folder ``folder``."""
    path = folder / "config.json"
    if not folder.is_dir():
        raise ModelLoadError(f"model folder {folder} does not exist")
    if not path.is_file():
        raise ModelLoadError(
            f"{folder} has no config.json; point --model at a Hugging Face model folder"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None
    config = parse_model_config(raw)
    # generation_config.json may name more end-of-sequence tokens than config.json.
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        try:
            gen = json.loads(gen_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            gen = {}
        eos = gen.get("eos_token_id")
        extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        merged = tuple(dict.fromkeys([*config.eos_token_ids, *map(int, extra)]))
        if merged != config.eos_token_ids:
            config = replace(config, eos_token_ids=merged)
    return config
