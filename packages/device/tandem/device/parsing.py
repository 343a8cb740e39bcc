"""``--devices`` text to devices: ``kind[:index]``, comma-separated, one kind, each once, of a
kind some installed runtime serves (``cpu`` always; others through the
``tandem.device_runtimes`` entry points or ``register_runtime``)."""

from __future__ import annotations

from tandem.device.device import Device
from tandem.device.runtime import known_device_kinds


def parse_device(text: str) -> Device:
    """Parse ``kind[:index]`` (``cpu``, ``cpu:1``, ``npu:3``)."""
    kind, sep, index = text.strip().partition(":")
    if not kind:
        raise ValueError(f"empty device name in {text!r}; write e.g. cpu:0 or npu:1")
    kind = kind.lower()
    known = known_device_kinds()
    if kind not in known:
        raise ValueError(
            f"unknown device kind {kind!r} in {text!r}; this install serves {', '.join(known)} "
            "(npu and cuda come with the hardware package: pip install -e hw)"
        )
    if not sep:
        return Device(kind, 0)
    try:
        return Device(kind, int(index))
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
