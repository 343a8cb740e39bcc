"""Two-level groups for several machines, each one process driving its local devices:
in-process among a node's ranks, torch.distributed among the node leaders (local rank 0).

Global rank = node_rank * local_size + local_rank. Results equal the flat group's up to
floating-point summation order (node sums are added across nodes)."""

from __future__ import annotations

import torch

from tandem.collectives.process_group import ProcessGroup, ReduceOp, check_scatterable


class TwoLevelGroup:
    def __init__(
        self, local: ProcessGroup, inter: ProcessGroup | None, node_rank: int, nnodes: int
    ) -> None:
        if (local.rank == 0) != (inter is not None):
            raise ValueError("exactly the node leader (local rank 0) holds the inter-node group")
        if inter is not None and (inter.size != nnodes or inter.rank != node_rank):
            raise ValueError(
                f"the inter-node group is rank {inter.rank} of {inter.size}, expected "
                f"{node_rank} of {nnodes}"
            )
        self._local = local
        self._inter = inter
        self._node_rank = node_rank
        self._nnodes = nnodes
        self._sequence = 0

    @property
    def rank(self) -> int:
        return self._node_rank * self._local.size + self._local.rank

    @property
    def size(self) -> int:
        return self._nnodes * self._local.size

    @property
    def sequence(self) -> int:
        return self._sequence

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        self._sequence += 1
        self._local.all_reduce(tensor, op)
        if self._inter is not None:
            self._inter.all_reduce(tensor, op)
        return self._local.broadcast(tensor, root=0)

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        self._sequence += 1
        node = self._local.all_gather(tensor, dim)
        if self._inter is not None:
            full = self._inter.all_gather(node, dim)
        else:
            shape = list(node.shape)
            shape[dim] *= self._nnodes
            full = torch.empty(shape, dtype=node.dtype, device=node.device)
        return self._local.broadcast(full, root=0)

    def reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        check_scatterable(tensor, self.size)
        full = self.all_reduce(tensor.clone(), op)
        return full.chunk(self.size, dim=0)[self.rank].clone()

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        if not 0 <= root < self.size:
            raise ValueError(f"root {root} is out of range for a group of size {self.size}")
        self._sequence += 1
        root_node, root_local = divmod(root, self._local.size)
        if self._node_rank == root_node:
            self._local.broadcast(tensor, root=root_local)
        if self._inter is not None:
            self._inter.broadcast(tensor, root=root_node)
        return self._local.broadcast(tensor, root=0)

    def barrier(self) -> None:
        self._sequence += 1
        self._local.barrier()
        if self._inter is not None:
            self._inter.barrier()
        self._local.barrier()
