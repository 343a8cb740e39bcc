"""Host tensors onto a device in one copy.

A step's metadata is a dozen small index tensors; copied one by one, each ``.to(device)``
from pageable memory is a blocking transfer that waits for the device's queue, a host sync
per tensor per step. Packed into one buffer (pinned where the device can read pinned memory)
and copied once without blocking, the host goes straight on to launch the step's kernels,
which the device runs after the copy in stream order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_ALIGN = 8


def to_device_once(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` (host) on ``device``, each with its own dtype and shape, through one
    non-blocking copy; on a CPU device, the tensors themselves."""
    if device.type == "cpu" or not tensors:
        return list(tensors)
    flat = [t.reshape(-1).contiguous().view(torch.uint8) for t in tensors]
    # Each piece starts on an 8-byte boundary, so every one can be viewed as its own dtype.
    offsets, total = [], 0
    for raw in flat:
        offsets.append(total)
        total += -(-raw.numel() // _ALIGN) * _ALIGN
    pinned = torch.accelerator.is_available()
    # Pinned: the copy needs no staging pass and leaves the host free at once; the caching
    # host allocator keeps the buffer alive until the copy has run.
    packed = torch.empty(total, dtype=torch.uint8, pin_memory=pinned)
    for raw, offset in zip(flat, offsets, strict=True):
        packed[offset : offset + raw.numel()].copy_(raw)
    moved = packed.to(device, non_blocking=True)
    return [
        moved[offset : offset + raw.numel()].view(t.dtype).view(t.shape)
        for t, raw, offset in zip(tensors, flat, offsets, strict=True)
    ]
