"""Which decoder projections a quantization config's list of module names picks, matched as
vLLM matches them: a name picks a projection when it is a substring of the projection's module
path (``model.layers.3.self_attn.q_proj``)."""

from __future__ import annotations

from tandem.core.layers.quant_scheme import FUSED_PROJECTIONS, PROJECTIONS


def picked_projections(names: list[str], num_layers: int) -> frozenset[str] | None:
    """The projections ``names`` pick, or None when that differs between layers (a model's
    layers are built alike here)."""
    per_layer = {
        frozenset(p for p in PROJECTIONS if any(n in f"model.layers.{i}.{p}" for n in names))
        for i in range(num_layers)
    }
    if len(per_layer) > 1:
        return None
    return next(iter(per_layer), frozenset())


def split_fused_group(quantized: frozenset[str]) -> tuple[str, ...] | None:
    """A group of projections computed in one matmul of which only some are in ``quantized``
    (they must be stored alike), or None."""
    for fused in FUSED_PROJECTIONS:
        if 0 < len(quantized.intersection(fused)) < len(fused):
            return fused
    return None
