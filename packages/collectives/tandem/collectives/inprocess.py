"""In-process groups: every rank is a thread of this process, and the communicators of all
ranks are created by one call (``create_inprocess_groups``, the ``HcclCommInitAll`` shape).

Each collective is a rendezvous keyed by the group's sequence number. Arrivals are checked
against the first arrival's fingerprint (op, shape, dtype, reduce op, root), so ranks that
issue different collectives fail at once instead of exchanging wrong data. Reductions add
in rank order whatever order the threads arrive in, so results are deterministic. A rank that
waits longer than the timeout, or a communicator aborted because another rank failed, raises.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.collectives.errors import CollectiveAborted, CollectiveMismatch, CollectiveTimeout
from tandem.collectives.process_group import ReduceOp, check_scatterable
from tandem.device.sync import REAL_SYNC, Sync

Fingerprint = tuple[Any, ...]


@dataclass
class _Round:
    fingerprint: Fingerprint
    first_rank: int
    inputs: list[torch.Tensor | None]
    arrived: int = 0
    taken: int = 0
    done: bool = False
    result: Any = None
    seen: set[int] = field(default_factory=set)


class InProcessCommunicator:
    """The state shared by all ranks of one in-process communicator set."""

    def __init__(self, size: int, timeout_s: float, sync: Sync = REAL_SYNC) -> None:
        if size < 1:
            raise ValueError(f"a communicator needs at least one rank, got {size}")
        self.size = size
        self.timeout_s = timeout_s
        self._sync = sync
        self._cond = sync.condition()
        self._rounds: dict[int, _Round] = {}
        self._error: BaseException | None = None

    def abort(self, reason: str) -> None:
        """Wake every waiting rank with an error; later collectives fail at once."""
        with self._cond:
            if self._error is None:
                self._error = CollectiveAborted(reason)
            self._cond.notify_all()

    def run(
        self,
        rank: int,
        seq: int,
        fingerprint: Fingerprint,
        tensor: torch.Tensor | None,
        compute: Callable[[list[torch.Tensor | None]], Any],
    ) -> Any:
        self._sync.yield_point(f"collective #{seq} {fingerprint[0]} rank {rank}")
        deadline = self._sync.monotonic() + self.timeout_s
        with self._cond:
            if self._error is not None:
                raise self._error
            rnd = self._rounds.get(seq)
            if rnd is None:
                rnd = _Round(fingerprint, rank, [None] * self.size)
                self._rounds[seq] = rnd
            elif fingerprint != rnd.fingerprint:
                self._error = CollectiveMismatch(
                    f"collective #{seq}: rank {rnd.first_rank} issued {rnd.fingerprint}, "
                    f"rank {rank} issued {fingerprint}"
                )
                self._cond.notify_all()
                raise self._error
            rnd.inputs[rank] = tensor
            rnd.seen.add(rank)
            rnd.arrived += 1
            if rnd.arrived == self.size:
                try:
                    rnd.result = compute(rnd.inputs)
                except BaseException as exc:
                    self._error = exc
                    self._cond.notify_all()
                    raise
                rnd.inputs = []
                rnd.done = True
                self._cond.notify_all()
            while not rnd.done:
                if self._error is not None:
                    raise self._error
                remaining = deadline - self._sync.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(self.size)) - rnd.seen)
                    raise CollectiveTimeout(
                        f"collective #{seq} {fingerprint[0]}: rank {rank} waited "
                        f"{self.timeout_s:.0f} s for ranks {missing}"
                    )
                self._cond.wait(remaining)
            rnd.taken += 1
            if rnd.taken == self.size:
                del self._rounds[seq]
            return rnd.result


def _sum_in_rank_order(inputs: list[torch.Tensor | None]) -> torch.Tensor:
    tensors = [t for t in inputs if t is not None]
    total = tensors[0].clone()
    for t in tensors[1:]:
        total += t
    return total


def _max(inputs: list[torch.Tensor | None]) -> torch.Tensor:
    tensors = [t for t in inputs if t is not None]
    total = tensors[0].clone()
    for t in tensors[1:]:
        torch.maximum(total, t, out=total)
    return total


class InProcessGroup:
    """One rank's handle on an in-process communicator; use it only from that rank's thread."""

    def __init__(self, comm: InProcessCommunicator, rank: int, name: str = "inprocess") -> None:
        self._comm = comm
        self._rank = rank
        self._sequence = 0
        self.name = name

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._comm.size

    @property
    def sequence(self) -> int:
        return self._sequence

    @property
    def communicator(self) -> InProcessCommunicator:
        return self._comm

    def _run(
        self,
        op: str,
        tensor: torch.Tensor | None,
        extra: tuple[Any, ...],
        compute: Callable[[list[torch.Tensor | None]], Any],
    ) -> Any:
        seq = self._sequence
        self._sequence += 1
        shape = None if tensor is None else (tuple(tensor.shape), str(tensor.dtype))
        return self._comm.run(self._rank, seq, (op, shape, *extra), tensor, compute)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        reduce = _sum_in_rank_order if op is ReduceOp.SUM else _max
        result = self._run("all_reduce", tensor, (op.value,), reduce)
        tensor.copy_(result)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        def gather(inputs: list[torch.Tensor | None]) -> torch.Tensor:
            return torch.cat([t for t in inputs if t is not None], dim=dim)

        # Every rank gets its own copy: the result may be written to afterwards.
        result: torch.Tensor = self._run("all_gather", tensor, (dim,), gather)
        return result.clone()

    def reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        check_scatterable(tensor, self.size)
        reduce = _sum_in_rank_order if op is ReduceOp.SUM else _max
        result: torch.Tensor = self._run("reduce_scatter", tensor, (op.value,), reduce)
        return result.chunk(self.size, dim=0)[self._rank].clone()

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        if not 0 <= root < self.size:
            raise ValueError(f"root {root} is out of range for a group of size {self.size}")

        def pick(inputs: list[torch.Tensor | None]) -> torch.Tensor:
            source = inputs[root]
            assert source is not None
            return source.clone()

        result = self._run("broadcast", tensor, (root,), pick)
        if self._rank != root:
            tensor.copy_(result)
        return tensor

    def barrier(self) -> None:
        self._run("barrier", None, (), lambda _: None)


def create_inprocess_groups(
    size: int, timeout_s: float = 300.0, sync: Sync = REAL_SYNC
) -> list[InProcessGroup]:
    """Communicators for all ``size`` local ranks, created at once; hand group ``r`` to the
    thread of rank ``r``."""
    comm = InProcessCommunicator(size, timeout_s, sync)
    return [InProcessGroup(comm, rank) for rank in range(size)]
