"""Several column-parallel projections of one input in one matmul, where a checkpoint tensor
may itself hold several sections (Gated DeltaNet's ``in_proj_qkv`` is q | k | v).

Every section is split evenly across ranks: rank r holds slice r of each section, the slices
laid side by side in section order, so its output splits into its part of every section.

Quantized, every tensor with an output axis is cut the same way along it: int8 weights and
their per-channel scales by rows; 4-bit ``qweight``, ``scales`` and ``qzeros`` by columns
(``qzeros`` and AWQ's ``qweight`` by packed words of 8 outputs, so each section's slice must
be whole words, else loading stops naming the tensor); ``g_idx`` (inputs only) is whole and
shared by the checkpoint tensors; static input scales one per checkpoint tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.collectives import ProcessGroup
from tandem.core.layers.linear import ColumnParallelLinear, _divide
from tandem.core.layers.quant_scheme import QuantScheme
from tandem.core.layers.weights import LazyTensor, copy_checked, read_shard


class SectionedColumnParallelLinear(ColumnParallelLinear):
    def __init__(
        self,
        in_features: int,
        sections: list[int],
        checkpoint_tensors: dict[str, list[int]],
        group: ProcessGroup,
        quant: QuantScheme | None = None,
    ):
        """``sections``: output sizes; ``checkpoint_tensors``: for each checkpoint tensor (by
        the shard id the model loads it with), the sections it holds, in its row order."""
        super().__init__(
            in_features,
            sum(sections),
            bias=False,
            group=group,
            quant=quant,
            input_sources=len(checkpoint_tensors),
        )
        self.local_sizes = [_divide(s, group.size, "projection section") for s in sections]
        self.sections = sections
        self.checkpoint_tensors = checkpoint_tensors

    def load_shard(self, param: nn.Parameter, loaded: LazyTensor, shard: str, name: str) -> None:
        if param is self.input_scale:
            self.load_input_scale(loaded, list(self.checkpoint_tensors).index(shard), name)
            return
        held = self.checkpoint_tensors[shard]
        split = self.output_split(param)
        if split is None:  # g_idx: inputs only, one per checkpoint tensor
            self.load_output_rows(param, loaded, name, 0, 0)
            return
        _check_rows(loaded.get_shape()[split.dim] * split.per_entry, held, self, name)
        source_offset = 0
        for i in held:
            size = self.local_sizes[i]
            start = source_offset + self.group.rank * size
            self.load_output_rows(param, loaded, name, start, size, sum(self.local_sizes[:i]))
            source_offset += self.sections[i]


def _check_rows(
    rows: int, held: list[int], layout: SectionedColumnParallelLinear, name: str
) -> None:
    expected = sum(layout.sections[i] for i in held)
    if rows != expected:
        raise ValueError(
            f"checkpoint tensor {name} has {rows} rows, the config.json implies {expected}; "
            "the config.json does not match the weights"
        )


def load_sections(
    dst: torch.Tensor,
    loaded: LazyTensor,
    held: list[int],
    layout: SectionedColumnParallelLinear,
    name: str,
) -> None:
    """Copy this rank's slice of each section in ``held`` from the float ``loaded`` (rows =
    dim 0) into ``dst``, whose rows follow ``layout``: tensors shaped like the projection's
    output (the conv weight)."""
    _check_rows(loaded.get_shape()[0], held, layout, name)
    source_offset = 0
    for i in held:
        size = layout.local_sizes[i]
        local_offset = sum(layout.local_sizes[:i])
        src = read_shard(loaded, 0, source_offset + layout.group.rank * size, size)
        # Flattened past dim 0: the conv weight is [C, 1, K] in checkpoints, [C, K] here.
        copy_checked(dst.narrow(0, local_offset, size).view(size, -1), src.reshape(size, -1), name)
        source_offset += layout.sections[i]
