"""Checkpoint tensors to a model's parameters, for every model (dense, MoE, hybrid, the
recommender): each model declares how its checkpoint names map (``WeightMapping``) and this
one loop loads them, so a new architecture writes a declaration, not a loader.

A checkpoint name is stripped of the first matching prefix; a routed expert's tensor goes to its
layer's stacked experts (``ExpertWeights``); a projection the checkpoint keeps apart and a layer
fuses is loaded as its shard of the fused parameter; anything else must name a parameter, or
the config.json does not match the weights and loading stops saying which tensor.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from tandem.core.layers.weights import LazyTensor
from tandem.core.models.expert_weights import ExpertWeights

logger = logging.getLogger(__name__)

# (checkpoint module name, our fused module, shard id)
FusedShard = tuple[str, str, str | int]

GATE_UP: tuple[FusedShard, ...] = (("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1))
QKV_GATE_UP: tuple[FusedShard, ...] = (
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    *GATE_UP,
)


@dataclass(frozen=True)
class WeightMapping:
    fused: tuple[FusedShard, ...] = ()
    # Stripped from a checkpoint name to reach the parameter path (the first that matches).
    prefixes: tuple[str, ...] = ()
    # Tensors of parts the model does not serve (a vision tower): skipped, said in one line
    # that names the parts (``unused``).
    unused_prefixes: tuple[str, ...] = ()
    unused: str = "parts it does not serve"
    # Buffers some checkpoints carry that are rebuilt here (rotary inverse frequencies).
    ignored: tuple[str, ...] = ()


def load_mapped_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, LazyTensor]],
    mapping: WeightMapping,
    what: str,
    tie_word_embeddings: bool = False,
) -> set[str]:
    """Load ``weights`` by their Hugging Face names; returns the parameters loaded. ``what``
    names the model in errors; with tied embeddings the checkpoint's ``lm_head`` is skipped and
    counts as loaded with the embedding."""
    params = dict(model.named_parameters(remove_duplicate=False))
    experts = ExpertWeights(model)
    loaded: set[str] = set()
    skipped = 0
    for name, tensor in weights:
        if any(part in name for part in mapping.ignored):
            continue
        if name.startswith(mapping.unused_prefixes):
            skipped += 1
            continue
        if name == "lm_head.weight" and tie_word_embeddings:
            continue
        target = _strip(name, mapping.prefixes)
        if experts.take(target, tensor, name):
            continue
        shard: str | int | None = None
        for checkpoint_name, fused, shard_id in mapping.fused:
            if f".{checkpoint_name}." in target:
                target = target.replace(f".{checkpoint_name}.", f".{fused}.")
                shard = shard_id
                break
        param = params.get(target)
        if param is None:
            raise ValueError(
                f"checkpoint tensor {name} matches no parameter of {what}; the config.json does "
                "not match the weights"
            )
        owner = model.get_submodule(target.rsplit(".", 1)[0])
        if shard is None:
            owner.load_weight(param, tensor, name)  # type: ignore[operator]
        else:
            owner.load_shard(param, tensor, shard, name)  # type: ignore[operator]
        loaded.add(target)
    if skipped:
        logger.info(
            "%s: skipped %d checkpoint tensors of %s (%s*)",
            what,
            skipped,
            mapping.unused,
            "*, ".join(mapping.unused_prefixes),
        )
    if tie_word_embeddings and "embed_tokens.weight" in loaded:
        loaded.add("lm_head.weight")
    return loaded | experts.loaded_parameters()


def _strip(name: str, prefixes: tuple[str, ...]) -> str:
    for prefix in prefixes:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name
