"""The device identifier: a kind and an index, parsed from ``cpu:0`` style strings."""

from __future__ import annotations

from dataclasses import dataclass

import torch

KNOWN_KINDS = ("cpu", "cuda", "npu")


@dataclass(frozen=True, order=True)
class Device:
    kind: str
    index: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KNOWN_KINDS:
            raise ValueError(
                f"unknown device kind {self.kind!r}; expected one of {', '.join(KNOWN_KINDS)}"
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


def parse_device(text: str) -> Device:
    """Parse ``kind[:index]`` (``cpu``, ``cpu:1``, ``npu:3``)."""
    kind, sep, index = text.strip().partition(":")
    if not kind:
        raise ValueError(f"empty device name in {text!r}; write e.g. cpu:0 or npu:1")
    if not sep:
        return Device(kind.lower(), 0)
    try:
        return Device(kind.lower(), int(index))
    except ValueError as exc:
        raise ValueError(f"bad device {text!r}: {exc}; write e.g. cpu:0 or npu:1") from None


def parse_devices(text: str) -> list[Device]:
    """Parse a comma-separated device list, refusing duplicates and mixed kinds."""
    devices = [parse_device(part) for part in text.split(",") if part.strip()]
    if not devices:
        raise ValueError("the device list is empty; write e.g. --devices cpu:0,cpu:1")
    if len(set(devices)) != len(devices):
        raise ValueError(f"device list {text!r} names a device twice")
    if len({d.kind for d in devices}) != 1:
        raise ValueError(f"device list {text!r} mixes device kinds; use one kind")
    return devices
