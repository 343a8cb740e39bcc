"""The one-rank group: tensor parallelism of size 1, every collective is the identity."""

from __future__ import annotations

import torch

from tandem.collectives.process_group import ReduceOp


class SingleRankGroup:
    def __init__(self) -> None:
        self._sequence = 0

    @property
    def rank(self) -> int:
        return 0

    @property
    def size(self) -> int:
        return 1

    @property
    def sequence(self) -> int:
        return self._sequence

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        self._sequence += 1
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        self._sequence += 1
        return tensor

    def reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        self._sequence += 1
        return tensor

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        if root != 0:
            raise ValueError(f"root {root} is out of range for a group of size 1")
        self._sequence += 1
        return tensor

    def barrier(self) -> None:
        self._sequence += 1
