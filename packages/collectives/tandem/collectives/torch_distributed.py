"""Process groups over torch.distributed: one rank per process, rendezvous at a master
address (or torchrun's environment). gloo on CPU; the backend is a parameter (hccl, nccl)."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tandem.collectives.errors import CollectiveAborted, CollectiveError, CollectiveTimeout
from tandem.collectives.process_group import ReduceOp, check_scatterable

logger = logging.getLogger(__name__)

# The master address that means "torchrun's environment".
TORCHRUN_ADDRESS = "env://"

_OPS = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MAX: dist.ReduceOp.MAX}


@dataclass(frozen=True)
class Rendezvous:
    master_addr: str
    master_port: int
    world_size: int
    rank: int
    # Meet through torchrun's own store (MASTER_ADDR/MASTER_PORT in the environment).
    from_env: bool = False

    @classmethod
    def parse(cls, address: str, world_size: int, rank: int) -> Rendezvous:
        if address == TORCHRUN_ADDRESS:
            env = cls.from_torchrun_env()
            if env is None:
                raise ValueError(
                    "env:// needs torchrun's MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE"
                )
            if (env.world_size, env.rank) != (world_size, rank):
                raise ValueError(
                    f"torchrun says rank {env.rank} of {env.world_size}, the configuration "
                    f"says {rank} of {world_size}"
                )
            return env
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"--master-node-addr must be HOST:PORT, got {address!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        return cls(host, int(port), world_size, rank)

    @classmethod
    def from_torchrun_env(cls) -> Rendezvous | None:
        """MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE as torchrun sets them, if present."""
        env = os.environ
        if not all(k in env for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")):
            return None
        return cls(
            env["MASTER_ADDR"],
            int(env["MASTER_PORT"]),
            int(env["WORLD_SIZE"]),
            int(env["RANK"]),
            from_env=True,
        )

    @property
    def init_method(self) -> str:
        if self.from_env:
            return "env://"
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{self.master_port}"


def init_distributed(rdzv: Rendezvous, backend: str, timeout_s: float = 600.0) -> None:
    """Join the world (once per process)."""
    if dist.is_initialized():
        return
    logger.info(
        "joining torch.distributed world of %d as rank %d at %s (%s)",
        rdzv.world_size,
        rdzv.rank,
        rdzv.init_method,
        backend,
    )
    dist.init_process_group(
        backend=backend,
        init_method=rdzv.init_method,
        world_size=rdzv.world_size,
        rank=rdzv.rank,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


class TorchDistributedGroup:
    """A torch.distributed group. Its collectives block the calling thread until done."""

    def __init__(self, backend: str, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("call init_distributed() before creating a TorchDistributedGroup")
        self.backend = backend
        self._group = group
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)
        self._ranks = (
            list(range(self._size)) if group is None else dist.get_process_group_ranks(group)
        )
        self._sequence = 0

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def sequence(self) -> int:
        return self._sequence

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        self._sequence += 1
        with _as_collective_errors():
            dist.all_reduce(tensor, op=_OPS[op], group=self._group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        self._sequence += 1
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self._size)]
        with _as_collective_errors():
            dist.all_gather(parts, tensor, group=self._group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        check_scatterable(tensor, self._size)
        self._sequence += 1
        if self.backend == "gloo":
            # gloo has no reduce_scatter: reduce everything, keep this rank's slice.
            full = tensor.clone()
            with _as_collective_errors():
                dist.all_reduce(full, op=_OPS[op], group=self._group)
            return full.chunk(self._size, dim=0)[self._rank].clone()
        out = torch.empty(
            (tensor.shape[0] // self._size, *tensor.shape[1:]),
            dtype=tensor.dtype,
            device=tensor.device,
        )
        with _as_collective_errors():
            dist.reduce_scatter_tensor(out, tensor.contiguous(), op=_OPS[op], group=self._group)
        return out

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        if not 0 <= root < self._size:
            raise ValueError(f"root {root} is out of range for a group of size {self._size}")
        self._sequence += 1
        with _as_collective_errors():
            dist.broadcast(tensor, src=self._ranks[root], group=self._group)
        return tensor

    def barrier(self) -> None:
        self._sequence += 1
        with _as_collective_errors():
            dist.barrier(group=self._group)


@contextlib.contextmanager
def _as_collective_errors() -> Iterator[None]:
    """A failed torch.distributed collective as the collectives' own errors: a peer that went
    away aborts this rank's collective, one that never came times it out. Callers can then
    tell the rank that failed from the ranks that failed because of it."""
    try:
        yield
    except RuntimeError as exc:
        text = str(exc)
        if "timed out" in text.lower() or "timeout" in text.lower():
            raise CollectiveTimeout(text) from exc
        if any(sign in text for sign in _PEER_GONE):
            raise CollectiveAborted(text) from exc
        raise CollectiveError(text) from exc


# What gloo and c10d say when the rank at the other end is gone.
_PEER_GONE = ("Connection closed", "Connection reset", "Broken pipe", "Connection refused")
