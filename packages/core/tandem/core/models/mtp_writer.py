"""Give a Qwen3.5 checkpoint a multi-token-prediction head (``mtp.*``) in the layout Qwen's
checkpoints ship it: ``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``,
``mtp.layers.0.*`` (a full-attention decoder layer, named as the model's) and ``mtp.norm``,
in a file of its own (``mtp.safetensors``, listed in the index when the folder has one), and
``mtp_num_hidden_layers: 1`` in ``config.json``.

``initial_head`` starts one from the checkpoint's last full-attention layer (a head that
already reads hidden states of this model), ``fc`` passing the hidden state through and a
little of the embedding; ``benchmarks/train_mtp_head.py`` trains it from there.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.core.errors import ModelLoadError
from tandem.core.models.config_json import load_model_config
from tandem.core.models.loader import weight_files
from tandem.core.models.qwen3_5 import Qwen3_5ForCausalLM
from tandem.core.models.qwen3_family_config import FULL_ATTENTION, family_config

MTP_FILE = "mtp.safetensors"
# Zero-centred norms: a zero weight scales by one.
_NORMS = ("mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_embedding.weight")


def last_full_attention_layer(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of the checkpoint's last full-attention decoder layer, named from the
    layer on (``self_attn.q_proj.weight``, ...)."""
    config = family_config(load_model_config(folder))
    full = [i for i, kind in enumerate(config.layer_types) if kind == FULL_ATTENTION]
    if not full:
        raise ModelLoadError(f"{folder} has no full-attention layer to start a head from")
    # Where the text model's tensors live, as the model's own loader finds them.
    prefixes = Qwen3_5ForCausalLM.WEIGHTS.prefixes
    wanted = tuple(f"{prefix}layers.{full[-1]}." for prefix in prefixes)
    layer: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not dicts
                for prefix in wanted:
                    if name.startswith(prefix):
                        layer[name[len(prefix) :]] = f.get_tensor(name)
    return layer


def initial_head(folder: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """A head for ``folder``'s model: its last full-attention layer, norms at one, ``fc``
    the identity on the hidden half and small random weights on the embedding half."""
    layer = last_full_attention_layer(folder)
    some = next(iter(layer.values()))
    hidden = load_model_config(folder).hidden_size
    gen = torch.Generator().manual_seed(seed)
    embed_part = torch.randn(hidden, hidden, generator=gen) * 0.02
    fc = torch.cat([embed_part, torch.eye(hidden)], dim=1).to(some.dtype)
    head = {f"mtp.layers.0.{name}": t.clone() for name, t in layer.items()}
    head["mtp.fc.weight"] = fc
    head.update({name: torch.zeros(hidden, dtype=some.dtype) for name in _NORMS})
    return head


def write_mtp_head(folder: Path, head: dict[str, torch.Tensor]) -> Path:
    """Save ``head`` (``mtp.*`` tensors) into the checkpoint folder and declare it."""
    bad = [name for name in head if not name.startswith("mtp.")]
    if bad:
        raise ValueError(f"not multi-token-prediction tensors: {', '.join(bad[:3])}")
    path = folder / MTP_FILE
    save_file({k: v.contiguous() for k, v in head.items()}, str(path), metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text(encoding="utf-8"))
        data["weight_map"].update({name: MTP_FILE for name in head})
        index.write_text(json.dumps(data, indent=2), encoding="utf-8")
    config_path = folder / "config.json"
    raw = json.loads(config_path.read_text(encoding="utf-8"))
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    text["mtp_num_hidden_layers"] = 1
    config_path.write_text(json.dumps(raw, indent=2), encoding="utf-8")
    return path
