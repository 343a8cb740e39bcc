"""Start-up refusal of a 4-bit checkpoint whose tensor-parallel shards would cut its packing:
a row-parallel projection whose inputs per rank are not whole quantization groups (a group's
scale and zero point would serve two ranks; in activation order, or with one group per
channel, every rank keeps every group, so whole packed words of 8 inputs suffice), or a
column-parallel one whose output sections per rank are not whole packed words of 8
(``qzeros``). Checked before anything is built or read, naming the layer, so the message says
what to change instead of which tensor failed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tandem.core.errors import ModelLoadError
from tandem.core.kernels.reference.int4_packing import PACK
from tandem.core.layers.quant_scheme import EXPERTS, QuantScheme, W4A16Scheme, projection_scheme
from tandem.core.models.qwen3_family_config import Qwen3FamilyConfig


@dataclass(frozen=True)
class ShardedProjection:
    """A projection of layer ``layer`` (``projection`` as the config names it): its inputs,
    where the ranks split them (row-parallel), else its output sections (column-parallel)."""

    layer: int
    projection: str
    split_inputs: int = 0
    output_sections: tuple[int, ...] = ()


def feed_forward_shards(config: Qwen3FamilyConfig, layer: int) -> list[ShardedProjection]:
    """The row-parallel projections of a Qwen3-family layer's feed-forward block: a dense
    MLP's down projection, or the routed experts' and a shared expert's."""
    if not config.moe_layers[layer]:
        return [ShardedProjection(layer, "mlp.down_proj", split_inputs=config.intermediate_size)]
    found = [ShardedProjection(layer, EXPERTS, split_inputs=config.moe_intermediate_size)]
    shared = config.shared_expert_intermediate_size
    if shared:
        found.append(ShardedProjection(layer, "mlp.shared_expert.down_proj", split_inputs=shared))
    return found


def _ranks_that_fit(fits: Callable[[int], bool], ranks: int) -> str:
    """The rank counts up to ``ranks`` that ``fits`` accepts, for the message."""
    return ", ".join(str(r) for r in range(1, ranks + 1) if fits(r)) or "none"


def check_int4_shards(
    quant: QuantScheme | None, projections: list[ShardedProjection], ranks: int
) -> None:
    """Refuse, naming the first layer that does not shard over ``ranks``."""
    if not isinstance(quant, W4A16Scheme):
        return
    # Each rank keeps every group where groups are channels or in activation order, so its
    # inputs need only fill whole packed words; else whole groups (every group size served
    # is a multiple of the word).
    whole_groups = quant.group_size == -1 or quant.desc_act
    unit = PACK if whole_groups else quant.group_size
    if whole_groups:
        cut = f"a packed word of {PACK} inputs (4-bit codes pack {PACK} to a word)"
    else:
        cut = f"a 4-bit quantization group of {unit} inputs (group_size {unit})"
    kept = "packed words" if whole_groups else "groups"
    for p in projections:
        if projection_scheme(quant, p.projection) is None:
            continue
        name = f"model.layers.{p.layer}.{p.projection}"
        inputs = p.split_inputs

        def whole(r: int, inputs: int = inputs) -> bool:
            return inputs % r == 0 and (inputs // r) % unit == 0

        if inputs and not whole(ranks):
            raise ModelLoadError(
                f"{name}: its {inputs} inputs over {ranks} tensor-parallel ranks would split "
                f"{cut} between two ranks; tensor-parallel sizes that keep whole {kept}: "
                f"{_ranks_that_fit(whole, ranks)}"
            )
        sections = p.output_sections

        def packed(r: int, sections: tuple[int, ...] = sections) -> bool:
            return all(s % r == 0 and (s // r) % PACK == 0 for s in sections)

        if sections and not packed(ranks):
            raise ModelLoadError(
                f"{name}: its output sections {list(sections)} over {ranks} tensor-parallel "
                f"ranks are not whole packed words of {PACK} outputs per rank (4-bit zero "
                f"points pack {PACK} to a word); tensor-parallel sizes that fit: "
                f"{_ranks_that_fit(packed, ranks)}"
            )
