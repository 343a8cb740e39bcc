"""The device identifier: a kind and an index (``cpu:0``). Which kinds exist is the runtime
registry's to say (``runtime.known_device_kinds``, ``parsing.py``): a device plugin adds one."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, order=True)
class Device:
    kind: str
    index: int = 0

    def __post_init__(self) -> None:
        if not (self.kind.isidentifier() and self.kind.islower()):
            raise ValueError(
                f"a device kind is a lowercase name (cpu, npu, ...), got {self.kind!r}"
            )
        if self.index < 0:
            raise ValueError(f"device index must be >= 0, got {self.index}")

    def __str__(self) -> str:
        return f"{self.kind}:{self.index}"

    def torch_device(self) -> torch.device:
        # Every CPU "device" is the same torch device; the index only names the worker.
        if self.kind == "cpu":
            return torch.device("cpu")
        return torch.device(self.kind, self.index)
