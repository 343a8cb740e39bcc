"""A fake collective backend on the simulator: every collective is a rendezvous keyed by
(group, sequence number). The first arrival's fingerprint (op, shape, dtype, reduce op, root)
is compared with each later one, and a difference raises at once with a field-by-field diff
naming the ranks. A rank waiting in a collective tells the scheduler exactly what it waits
for, so a deadlock is reported as a wait-for graph. Results are computed for real."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from tandem.collectives import CollectiveAborted, CollectiveMismatch, ReduceOp
from tandem.collectives.process_group import check_scatterable
from tandem_sim.scheduler import DeterministicScheduler

_FIELDS = ("op", "shape", "dtype", "reduce_op", "root")


@dataclass
class _Rendezvous:
    fingerprint: tuple[Any, ...]
    first_rank: int
    inputs: dict[int, torch.Tensor | None] = field(default_factory=dict)
    result: Any = None
    done: bool = False
    taken: int = 0


class FakeBackend:
    """The shared state of one group's ranks (create with ``groups``)."""

    def __init__(self, scheduler: DeterministicScheduler, name: str, size: int) -> None:
        self.scheduler = scheduler
        self.name = name
        self.size = size
        self._pending: dict[int, _Rendezvous] = {}
        self.aborted: str | None = None

    def abort(self, reason: str) -> None:
        """Fail every waiting and later collective (another rank failed)."""
        self.aborted = reason

    def groups(self) -> list[FakeGroup]:
        return [FakeGroup(self, rank) for rank in range(self.size)]

    def run(
        self,
        rank: int,
        seq: int,
        fingerprint: tuple[Any, ...],
        tensor: torch.Tensor | None,
        compute: Any,
    ) -> Any:
        s = self.scheduler
        s.yield_point(f"{self.name} #{seq} {fingerprint[0]} rank {rank}")
        if self.aborted is not None:
            raise CollectiveAborted(self.aborted)
        rdv = self._pending.get(seq)
        if rdv is None:
            rdv = _Rendezvous(fingerprint, rank)
            self._pending[seq] = rdv
        elif fingerprint != rdv.fingerprint:
            diff = ", ".join(
                f"{name}: rank {rdv.first_rank} {a!r} vs rank {rank} {b!r}"
                for name, a, b in zip(_FIELDS, rdv.fingerprint, fingerprint, strict=False)
                if a != b
            )
            raise CollectiveMismatch(f"group {self.name} collective #{seq}: {diff}")
        rdv.inputs[rank] = tensor
        if len(rdv.inputs) == self.size:
            rdv.result = compute([rdv.inputs[r] for r in range(self.size)])
            rdv.done = True
        while not rdv.done:
            missing = sorted(set(range(self.size)) - set(rdv.inputs))
            s.block(
                f"group {self.name} #{seq} {fingerprint[0]} (rank {rank}), waiting for ranks "
                f"{missing}",
                partial(_arrived, rdv, self),
            )
            if self.aborted is not None:
                raise CollectiveAborted(self.aborted)
        rdv.taken += 1
        if rdv.taken == self.size:
            del self._pending[seq]
        return rdv.result


def _arrived(rdv: _Rendezvous, backend: FakeBackend) -> bool:
    return rdv.done or backend.aborted is not None


class FakeGroup:
    """One rank's ``ProcessGroup`` on a fake backend."""

    def __init__(self, backend: FakeBackend, rank: int) -> None:
        self._backend = backend
        self._rank = rank
        self._sequence = 0

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._backend.size

    @property
    def sequence(self) -> int:
        return self._sequence

    def _run(self, op: str, tensor: torch.Tensor | None, reduce_op: str | None,
             root: int | None, compute: Any) -> Any:  # fmt: skip
        seq = self._sequence
        self._sequence += 1
        shape = None if tensor is None else tuple(tensor.shape)
        dtype = None if tensor is None else str(tensor.dtype)
        return self._backend.run(self._rank, seq, (op, shape, dtype, reduce_op, root), tensor,
                                 compute)  # fmt: skip

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        def reduce(inputs: list[torch.Tensor]) -> torch.Tensor:
            out = inputs[0].clone()
            for t in inputs[1:]:
                if op is ReduceOp.SUM:
                    out += t
                else:
                    torch.maximum(out, t, out=out)
            return out

        tensor.copy_(self._run("all_reduce", tensor, op.value, None, reduce))
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        result: torch.Tensor = self._run(
            "all_gather", tensor, None, None, lambda inputs: torch.cat(inputs, dim=dim)
        )
        return result.clone()

    def reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        check_scatterable(tensor, self.size)
        full = self.all_reduce(tensor.clone(), op)
        return full.chunk(self.size, dim=0)[self._rank].clone()

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        result = self._run("broadcast", tensor, None, root, lambda inputs: inputs[root].clone())
        tensor.copy_(result)
        return tensor

    def barrier(self) -> None:
        self._run("barrier", None, None, None, lambda inputs: None)
