"""Which decoder modules a quantization config's list of module names picks, matched as vLLM
matches them: a name picks a projection when it is a substring of the projection's module path
(``model.layers.3.self_attn.q_proj``); the routed experts of a mixture-of-experts layer are
one module to vLLM (``model.layers.3.mlp.experts``), whose checkpoint tensors are named per
expert (``model.layers.3.mlp.experts.7.gate_proj``)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.core.layers.quant_scheme import (
    EXPERT_PROJECTIONS,
    EXPERTS,
    FUSED_PROJECTIONS,
    LINEAR_ATTENTION_PROJECTIONS,
    PROJECTIONS,
    SHARED_EXPERT_PROJECTIONS,
)

# The dense MLP's projections (absent from a mixture-of-experts layer), and attention's
# (absent from a linear-attention layer).
_MLP = tuple(p for p in PROJECTIONS if p.startswith("mlp."))
_ATTENTION = tuple(p for p in PROJECTIONS if p not in _MLP)


@dataclass(frozen=True)
class DecoderLayout:
    """Which quantizable modules each decoder layer has: attention's projections, or (layers
    in ``linear_attention_layers``) a Gated DeltaNet's; the dense MLP's, or (layers in
    ``moe_layers``) ``num_experts`` routed experts, a router and, with ``shared_expert``, a
    shared expert and its gate."""

    num_layers: int
    moe_layers: frozenset[int] = frozenset()
    num_experts: int = 0
    linear_attention_layers: frozenset[int] = frozenset()
    shared_expert: bool = False

    @property
    def has_experts(self) -> bool:
        return bool(self.moe_layers)

    def projections(self, layer: int) -> tuple[str, ...]:
        """The projections layer ``layer`` has (routed experts apart)."""
        linear = layer in self.linear_attention_layers
        mixer = LINEAR_ATTENTION_PROJECTIONS if linear else _ATTENTION
        if layer not in self.moe_layers:
            return mixer + _MLP
        return mixer + (SHARED_EXPERT_PROJECTIONS if self.shared_expert else ())

    def experts_module(self, layer: int) -> str:
        """vLLM's name of a layer's routed experts (what AWQ's skip list is matched against)."""
        return f"model.layers.{layer}.{EXPERTS}"

    def expert_paths(self, layer: int) -> list[str]:
        """Every routed expert projection's module path in layer ``layer`` (none: dense)."""
        if layer not in self.moe_layers:
            return []
        prefix = self.experts_module(layer)
        return [f"{prefix}.{e}.{p}" for e in range(self.num_experts) for p in EXPERT_PROJECTIONS]

    def router(self, layer: int) -> str:
        return f"model.layers.{layer}.mlp.gate"

    def always_float(self, layer: int) -> list[str]:
        """The linear modules of layer ``layer`` served float whatever the config says (the
        router and the shared expert's gate, as vLLM builds them)."""
        if layer not in self.moe_layers:
            return []
        gates = [self.router(layer)]
        if self.shared_expert:
            gates.append(f"model.layers.{layer}.mlp.shared_expert_gate")
        return gates

    def modules(self, layer: int, experts_whole: bool) -> dict[str, str]:
        """Each quantizable module of layer ``layer`` (a projection, or ``EXPERTS``) and the
        paths a name may pick it by, one a line: the experts by vLLM's module name only
        (``experts_whole``, as AWQ's skip list is read), or also by each expert projection's."""
        found = {p: f"model.layers.{layer}.{p}" for p in self.projections(layer)}
        if layer in self.moe_layers:
            paths = [self.experts_module(layer)]
            if not experts_whole:
                paths += self.expert_paths(layer)
            found[EXPERTS] = "\n".join(paths)
        return found

    def all_quantizable(self) -> frozenset[str]:
        """Every projection (the dense decoder's whether or not a layer has them), and the
        experts where there are some."""
        found = {p for i in range(self.num_layers) for p in self.projections(i)}
        experts = {EXPERTS} if self.has_experts else set()
        return frozenset(PROJECTIONS) | found | experts


def _picks(name: str, paths: str) -> bool:
    """Whether ``name`` is a substring of one of ``paths`` (one a line; no name holds a line
    break, so none matches across two)."""
    return "\n" not in name and name in paths


def unmatched_names(names: list[str], layout: DecoderLayout) -> list[str]:
    """The names that pick no module of any layer."""
    paths = "\n".join(
        found
        for i in range(layout.num_layers)
        for found in layout.modules(i, experts_whole=False).values()
    )
    return [n for n in names if not _picks(n, paths)]


def picked_projections(
    names: list[str], layout: DecoderLayout, experts_whole: bool = False
) -> frozenset[str] | None:
    """The modules (projections, ``EXPERTS``) ``names`` pick, or None when that differs
    between the layers that have the module (a model's layers are built alike here)."""
    picks: dict[str, set[bool]] = {}
    for i in range(layout.num_layers):
        for module, paths in layout.modules(i, experts_whole).items():
            picks.setdefault(module, set()).add(any(_picks(n, paths) for n in names))
    if any(len(seen) > 1 for seen in picks.values()):
        return None
    return frozenset(module for module, seen in picks.items() if True in seen)


def split_fused_group(quantized: frozenset[str]) -> tuple[str, ...] | None:
    """A group of projections computed in one matmul of which only some are in ``quantized``
    (they must be stored alike), or None."""
    for fused in FUSED_PROJECTIONS:
        if 0 < len(quantized.intersection(fused)) < len(fused):
            return fused
    return None
