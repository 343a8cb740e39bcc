"""The process-group interface every backend implements."""

from __future__ import annotations

import enum
from typing import Protocol

import torch


class ReduceOp(enum.Enum):
    SUM = "sum"
    MAX = "max"


class ProcessGroup(Protocol):
    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def sequence(self) -> int:
        """How many collectives this rank has issued on this group."""
        ...

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        """Reduce ``tensor`` across ranks in place and return it."""
        ...

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along ``dim``, in rank order."""
        ...

    def reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        """Reduce across ranks, then return this rank's equal slice along dim 0."""
        ...

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Copy ``root``'s tensor into every rank's ``tensor`` and return it."""
        ...

    def barrier(self) -> None: ...


def check_scatterable(tensor: torch.Tensor, size: int) -> None:
    """reduce_scatter hands each rank an equal slice of dim 0."""
    if tensor.shape[0] % size:
        raise ValueError(f"reduce_scatter needs dim 0 ({tensor.shape[0]}) divisible by {size}")
