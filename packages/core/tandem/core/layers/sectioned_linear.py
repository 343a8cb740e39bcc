"""Several column-parallel projections of one input in one matmul, where a checkpoint tensor
may itself hold several sections (Gated DeltaNet's ``in_proj_qkv`` is q | k | v).

Every section is split evenly across ranks: rank r holds slice r of each section, the slices
laid side by side in section order, so its output splits into its part of every section.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.collectives import ProcessGroup
from tandem.core.layers.linear import ColumnParallelLinear, _divide
from tandem.core.layers.weights import LazyTensor, copy_checked, read_shard


class SectionedColumnParallelLinear(ColumnParallelLinear):
    def __init__(
        self,
        in_features: int,
        sections: list[int],
        checkpoint_tensors: dict[str, list[int]],
        group: ProcessGroup,
    ):
        """``sections``: output sizes; ``checkpoint_tensors``: for each checkpoint tensor (by
        the shard id the model loads it with), the sections it holds, in its row order."""
        super().__init__(in_features, sum(sections), bias=False, group=group)
        self.local_sizes = [_divide(s, group.size, "projection section") for s in sections]
        self.sections = sections
        self.checkpoint_tensors = checkpoint_tensors

    def load_shard(self, param: nn.Parameter, loaded: LazyTensor, shard: str, name: str) -> None:
        load_sections(param.data, loaded, self.checkpoint_tensors[shard], self, name)


def load_sections(
    dst: torch.Tensor,
    loaded: LazyTensor,
    held: list[int],
    layout: SectionedColumnParallelLinear,
    name: str,
) -> None:
    """Copy this rank's slice of each section in ``held`` from ``loaded`` (rows = dim 0) into
    ``dst``, whose rows follow ``layout``; also used for tensors shaped like the projection's
    output (the conv weight)."""
    rows = sum(layout.sections[i] for i in held)
    if loaded.get_shape()[0] != rows:
        raise ValueError(
            f"checkpoint tensor {name} has {loaded.get_shape()[0]} rows, the config.json "
            f"implies {rows}; the config.json does not match the weights"
        )
    source_offset = 0
    for i in held:
        size = layout.local_sizes[i]
        local_offset = sum(layout.local_sizes[:i])
        src = read_shard(loaded, 0, source_offset + layout.group.rank * size, size)
        # Flattened past dim 0: the conv weight is [C, 1, K] in checkpoints, [C, K] here.
        copy_checked(dst.narrow(0, local_offset, size).view(size, -1), src.reshape(size, -1), name)
        source_offset += layout.sections[i]
