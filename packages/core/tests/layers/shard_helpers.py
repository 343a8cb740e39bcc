"""Building a parallel layer as one rank of a group, and loading checkpoint tensors into it,
without collectives (loading and column-parallel forwards issue none)."""

from __future__ import annotations

from typing import cast

import torch

from tandem.collectives import ProcessGroup
from tandem.core.layers.quantized_linear import QuantizableLinear

from ..conftest import HeldTensor


class _Rank:
    """Just the coordinates a layer shards by."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


def rank_of(rank: int, size: int) -> ProcessGroup:
    return cast(ProcessGroup, _Rank(rank, size))


def load_tensors(
    layer: QuantizableLinear, tensors: dict[str, torch.Tensor], shard: object = None
) -> None:
    """Load ``tensors`` by parameter name (as part ``shard`` of a fused layer)."""
    params = dict(layer.named_parameters())
    for name, tensor in tensors.items():
        if shard is None:
            layer.load_weight(params[name], HeldTensor(tensor), name)  # type: ignore[operator]
        else:
            layer.load_shard(params[name], HeldTensor(tensor), shard, name)  # type: ignore[operator]
