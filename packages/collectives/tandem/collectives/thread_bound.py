"""A group that is, on each thread, the group that thread was bound to.

Several pipeline lanes run one model at once, each lane on its own threads. Sharing one
communicator between them would let two lanes' collectives interleave in different orders on
different ranks (concurrency rule 2), so each lane gets a communicator set of its own, and the
model's layers reach the calling lane's group through this one. A thread that was never bound
fails loudly instead of borrowing another lane's group.
"""

from __future__ import annotations

import threading

import torch

from tandem.collectives.process_group import ProcessGroup, ReduceOp


class ThreadBoundGroup:
    def __init__(self, groups: list[ProcessGroup]) -> None:
        if not groups:
            raise ValueError("a thread-bound group needs at least one group")
        if len({(g.rank, g.size) for g in groups}) != 1:
            raise ValueError("every lane's group must have this rank's rank and size")
        self.groups = groups
        self._local = threading.local()

    def bind(self, lane: int) -> None:
        """Make lane ``lane``'s group the calling thread's."""
        self._local.group = self.groups[lane]

    def _current(self) -> ProcessGroup:
        group: ProcessGroup | None = getattr(self._local, "group", None)
        if group is None:
            raise RuntimeError(
                f"thread {threading.current_thread().name} issued a collective without a "
                "pipeline lane's group bound"
            )
        return group

    @property
    def rank(self) -> int:
        return self.groups[0].rank

    @property
    def size(self) -> int:
        return self.groups[0].size

    @property
    def sequence(self) -> int:
        return self._current().sequence

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        return self._current().all_reduce(tensor, op)

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return self._current().all_gather(tensor, dim)

    def reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        return self._current().reduce_scatter(tensor, op)

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        return self._current().broadcast(tensor, root)

    def barrier(self) -> None:
        self._current().barrier()
