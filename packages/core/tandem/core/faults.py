"""Fault injection for tests: a typed description of the faults to inject, parsed once from
``TANDEM_FAULTS`` at start-up and handed down through the engine's config to every worker
(worker processes get it with the config). Off by default; with no faults every hook below
is a no-op.

``TANDEM_FAULTS`` holds faults separated by ``;``, each ``kind:key=value,...``:

===========================  ================================================================
``forward_raise``            rank ``rank`` raises at the start of its step number ``step``
``forward_delay``            rank ``rank`` sleeps ``seconds`` before its step number ``step``
``collective_fail``          rank ``rank``'s collective number ``collective`` (0 = the first)
                             of its step number ``step`` fails
``kernel_registration_fail`` every kernel registration on rank ``rank`` fails (so its first
                             forward does)
``kv_exhaust``               from engine step number ``step`` on, every KV block that is free
                             is taken away and never given back (a leak that starves the
                             engine: its watchdog must fail the requests)
===========================  ================================================================

Steps are counted from 0, per worker (each step a worker runs) or per engine (``kv_exhaust``).
Example: ``TANDEM_FAULTS="forward_raise:rank=1,step=3"``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tandem.collectives import CollectiveError, ProcessGroup, ReduceOp
from tandem.core.errors import ConfigError
from tandem.device import Device, DeviceRuntime, MemoryInfo
from tandem.device.runtime import DeviceStream

if TYPE_CHECKING:
    from tandem.core.kv.block_manager import BlockManager

logger = logging.getLogger(__name__)

ENV_VAR = "TANDEM_FAULTS"

KINDS = (
    "forward_raise",
    "forward_delay",
    "collective_fail",
    "kernel_registration_fail",
    "kv_exhaust",
)
_KEYS = {
    "forward_raise": {"rank", "step"},
    "forward_delay": {"rank", "step", "seconds"},
    "collective_fail": {"rank", "step", "collective"},
    "kernel_registration_fail": {"rank"},
    "kv_exhaust": {"step"},
}


class InjectedFault(RuntimeError):
    """What an injected fault raises (tests look for its name in the errors)."""


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int = 0
    step: int = 0
    seconds: float = 0.0
    collective: int = 0


@dataclass(frozen=True)
class FaultConfig:
    faults: tuple[Fault, ...] = ()

    @property
    def active(self) -> bool:
        return bool(self.faults)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> FaultConfig:
        config = cls.parse(environ.get(ENV_VAR, ""))
        if config.active:
            logger.warning("%s is set: this engine will fail on purpose (%s)", ENV_VAR,
                           environ[ENV_VAR])  # fmt: skip
        return config

    @classmethod
    def parse(cls, spec: str) -> FaultConfig:
        """ConfigError, saying what is accepted, for anything it cannot read."""
        faults = []
        for item in (part.strip() for part in spec.split(";")):
            if not item:
                continue
            kind, _, args = item.partition(":")
            kind = kind.strip()
            if kind not in _KEYS:
                raise ConfigError(
                    f"{ENV_VAR}: unknown fault {kind!r}; choose from {', '.join(KINDS)}"
                )
            values: dict[str, Any] = {}
            for pair in (p.strip() for p in args.split(",")):
                if not pair:
                    continue
                key, sep, value = pair.partition("=")
                key = key.strip()
                if not sep or key not in _KEYS[kind]:
                    raise ConfigError(
                        f"{ENV_VAR}: {kind} takes {', '.join(sorted(_KEYS[kind]))}=VALUE, "
                        f"got {pair!r}"
                    )
                try:
                    values[key] = float(value) if key == "seconds" else int(value)
                except ValueError:
                    raise ConfigError(f"{ENV_VAR}: {key}={value!r} is not a number") from None
                if values[key] < 0:
                    raise ConfigError(f"{ENV_VAR}: {key} must be >= 0, got {value}")
            faults.append(Fault(kind=kind, **values))
        return cls(tuple(faults))

    def for_rank(self, rank: int) -> RankFaults:
        mine = (f for f in self.faults if f.rank == rank and f.kind != "kv_exhaust")
        return RankFaults(tuple(mine))

    def kv_exhaust_step(self) -> int | None:
        """The engine step before which every free KV block is taken, if any."""
        steps = [f.step for f in self.faults if f.kind == "kv_exhaust"]
        return min(steps) if steps else None


class KvExhaustion:
    """The engine's hook for ``kv_exhaust``, called before each of its steps."""

    def __init__(self, config: FaultConfig, block_manager: BlockManager) -> None:
        self._step = config.kv_exhaust_step()
        self._blocks = block_manager
        self._steps_taken = 0

    def before_step(self) -> None:
        """From the step the fault names on, every block that is free is taken for good."""
        blocks = self._blocks
        if self._step is not None and self._steps_taken >= self._step and blocks.num_free_blocks:
            taken = blocks.num_free_blocks
            blocks.reserve(taken)
            logger.warning("injected fault: %d free KV blocks taken away for good", taken)
        self._steps_taken += 1


class RankFaults:
    """One rank's faults, and the hooks its worker calls."""

    def __init__(self, faults: tuple[Fault, ...]) -> None:
        self._faults = faults
        # Steps are numbered by one thread per worker: its own (one step at a time), or the
        # engine's, which submits every lane step.
        self._steps = 0
        # The step whose collectives are counted (and the count so far), per thread: with
        # pipeline lanes, steps run on several threads at once.
        self._local = threading.local()

    @property
    def active(self) -> bool:
        return bool(self._faults)

    def next_step(self) -> int:
        """Number the next step this rank runs (in submission order)."""
        if not self._faults:
            return 0
        index = self._steps
        self._steps += 1
        return index

    def before_forward(self, rank: int, step: int) -> None:
        """At the start of step ``step`` on this rank's worker (or lane) thread."""
        if not self._faults:
            return
        self._local.step, self._local.collectives = step, 0
        for fault in self._faults:
            if fault.step != step:
                continue
            if fault.kind == "forward_delay":
                logger.warning("injected fault: rank %d sleeps %.1f s at step %d", rank,
                               fault.seconds, step)  # fmt: skip
                threading.Event().wait(fault.seconds)
            elif fault.kind == "forward_raise":
                raise InjectedFault(f"injected fault: forward raised at step {step}")

    def before_collective(self, op: str) -> None:
        step = getattr(self._local, "step", None)
        if step is None:
            return
        index = self._local.collectives
        self._local.collectives = index + 1
        for fault in self._faults:
            if fault.kind == "collective_fail" and (fault.step, fault.collective) == (step, index):
                raise CollectiveError(
                    f"injected fault: {op} (collective {index} of step {step}) failed"
                )

    def wrap_group(self, group: ProcessGroup) -> ProcessGroup:
        if not any(f.kind == "collective_fail" for f in self._faults):
            return group
        return FaultyGroup(group, self.before_collective)

    def wrap_runtime(self, runtime: DeviceRuntime) -> DeviceRuntime:
        if not any(f.kind == "kernel_registration_fail" for f in self._faults):
            return runtime
        return FailingRegistrationRuntime(runtime)


NO_FAULTS = RankFaults(())


class FaultyGroup:
    """A group whose collectives first ask the rank's faults whether to fail."""

    def __init__(self, inner: ProcessGroup, check: Callable[[str], None]) -> None:
        self._inner = inner
        self._check = check

    @property
    def rank(self) -> int:
        return self._inner.rank

    @property
    def size(self) -> int:
        return self._inner.size

    @property
    def sequence(self) -> int:
        return self._inner.sequence

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        self._check("all_reduce")
        return self._inner.all_reduce(tensor, op)

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        self._check("all_gather")
        return self._inner.all_gather(tensor, dim)

    def reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        self._check("reduce_scatter")
        return self._inner.reduce_scatter(tensor, op)

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        self._check("broadcast")
        return self._inner.broadcast(tensor, root)

    def barrier(self) -> None:
        self._check("barrier")
        self._inner.barrier()


class FailingRegistrationRuntime:
    """A device runtime whose kernel registrations fail, everything else passed through."""

    def __init__(self, inner: DeviceRuntime) -> None:
        self._inner = inner
        self.kind = inner.kind
        self.kernel_families = inner.kernel_families

    def bind(self, device: Device) -> None:
        self._inner.bind(device)

    def torch_device(self, device: Device) -> Any:
        return self._inner.torch_device(device)

    def current_device(self) -> Device | None:
        return self._inner.current_device()

    def current_stream(self) -> Any:
        return self._inner.current_stream()

    def synchronize(self) -> None:
        self._inner.synchronize()

    def memory_info(self, device: Device) -> MemoryInfo:
        return self._inner.memory_info(device)

    def device_count(self) -> int:
        return self._inner.device_count()

    def load_kernel(
        self, name: str, impl: Callable[..., Any], device: Device
    ) -> Callable[..., Any]:
        raise InjectedFault(f"injected fault: registering kernel {name} on {device} failed")

    def new_stream(self, name: str) -> DeviceStream:
        return self._inner.new_stream(name)
