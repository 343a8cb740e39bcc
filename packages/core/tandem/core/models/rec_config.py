"""The configuration of a generative-recommendation model (``config.json`` of its folder)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.core.errors import ModelLoadError

REC_ARCHITECTURE = "GenerativeRecommender"


@dataclass(frozen=True)
class RecModelConfig:
    # An item is a tuple of semantic ids, one per codebook level.
    num_codebooks: int
    codebook_size: int
    hidden_size: int
    num_heads: int
    head_dim: int
    intermediate_size: int
    num_encoder_layers: int
    num_decoder_layers: int
    # Longest user history (items) the encoder reads.
    max_history: int
    rms_norm_eps: float = 1e-6
    # Beams per request unless the request asks for more candidates.
    beam_width: int = 8
    torch_dtype: str = "float32"

    @property
    def max_decode_rounds(self) -> int:
        """Rounds after the prefill: the prefill emits level 0, each round one more level."""
        return self.num_codebooks - 1

    def __post_init__(self) -> None:
        if self.num_codebooks < 1 or self.codebook_size < 2:
            raise ModelLoadError("a recommender needs num_codebooks >= 1 and codebook_size >= 2")
        if self.codebook_size**self.num_codebooks >= 2**62:
            raise ModelLoadError("codebook_size ** num_codebooks must fit in 62 bits")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RecModelConfig:
        fields = {
            "num_codebooks": int,
            "codebook_size": int,
            "hidden_size": int,
            "num_attention_heads": int,
            "head_dim": int,
            "intermediate_size": int,
            "num_encoder_layers": int,
            "num_decoder_layers": int,
            "max_history": int,
        }
        missing = [name for name in fields if name not in raw]
        if missing:
            raise ModelLoadError(f"config.json of a recommender lacks {', '.join(missing)}")
        try:
            return cls(
                num_codebooks=int(raw["num_codebooks"]),
                codebook_size=int(raw["codebook_size"]),
                hidden_size=int(raw["hidden_size"]),
                num_heads=int(raw["num_attention_heads"]),
                head_dim=int(raw["head_dim"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_encoder_layers=int(raw["num_encoder_layers"]),
                num_decoder_layers=int(raw["num_decoder_layers"]),
                max_history=int(raw["max_history"]),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                beam_width=int(raw.get("beam_width", 8)),
                torch_dtype=str(raw.get("torch_dtype", "float32")),
            )
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json has a malformed field: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        return {
            "architectures": [REC_ARCHITECTURE],
            "model_type": "tandem_rec",
            "num_codebooks": self.num_codebooks,
            "codebook_size": self.codebook_size,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "num_encoder_layers": self.num_encoder_layers,
            "num_decoder_layers": self.num_decoder_layers,
            "max_history": self.max_history,
            "rms_norm_eps": self.rms_norm_eps,
            "beam_width": self.beam_width,
            "torch_dtype": self.torch_dtype,
        }


def is_rec_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a recommender (by its config's architecture)."""
    try:
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    return REC_ARCHITECTURE in (raw.get("architectures") or [])


def load_rec_config(folder: Path) -> RecModelConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder} has no config.json")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None
    return RecModelConfig.from_dict(raw)
