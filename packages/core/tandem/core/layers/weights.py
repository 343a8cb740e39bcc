"""Lazy checkpoint tensors, the shard arithmetic the parallel layers load with, and what a
module's weights take in memory."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class LazyTensor(Protocol):
    """A checkpoint tensor not yet read: its shape, and reading a slice of it."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: object) -> torch.Tensor: ...


def read_shard(loaded: LazyTensor, dim: int, start: int, length: int) -> torch.Tensor:
    """Read only ``[start, start + length)`` along ``dim`` from the checkpoint."""
    shape = loaded.get_shape()
    if start == 0 and length == shape[dim]:
        return loaded[tuple(slice(None) for _ in shape)]
    index = [slice(None)] * len(shape)
    index[dim] = slice(start, start + length)
    return loaded[tuple(index)]


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"checkpoint tensor {name} has shape {tuple(src.shape)}, the model expects "
            f"{tuple(dst.shape)}; the config.json does not match the weights"
        )
    if dst.dtype != src.dtype and not (dst.is_floating_point() and src.is_floating_point()):
        # A copy would cast silently: integer codes read as floats, floats truncated to
        # integers, or packed int32 words to int8.
        raise ValueError(
            f"checkpoint tensor {name} is {src.dtype}, the model expects {dst.dtype}; "
            "config.json's quantization_config does not match the weights"
        )
    dst.copy_(src)


def parameter_bytes(module: nn.Module) -> int:
    """Bytes ``module``'s parameters take; a tensor shared by several (tied embeddings) once."""
    seen: set[int] = set()
    total = 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def per_tensor_scale(loaded: LazyTensor, name: str) -> torch.Tensor:
    """A static per-tensor activation scale (``input_scale``): one value, as a 0-d tensor."""
    shape = loaded.get_shape()
    if [d for d in shape if d != 1]:
        raise ValueError(
            f"checkpoint tensor {name} has shape {tuple(shape)}; a per-tensor input scale "
            "holds one value (the quantization_config says strategy 'tensor')"
        )
    return loaded[tuple(slice(None) for _ in shape)].reshape(())


def copy_channels(
    dst: torch.Tensor,
    loaded: LazyTensor,
    dim: int,
    per_entry: int,
    start: int,
    size: int,
    name: str,
    offset: int = 0,
    what: str = "outputs",
    unit: str = "packed words",
) -> None:
    """Channels ``[start, start + size)`` of the checkpoint tensor along ``dim``, stored
    ``per_entry`` to an entry (8 a packed word, a group's inputs a scales row), into ``dst``
    from channel ``offset``; refused where a bound would cut an entry."""
    n = per_entry
    if (offset | start | size) % n:
        raise ValueError(
            f"checkpoint tensor {name}: {what} {start}..{start + size} of this rank do not "
            f"fall on whole {unit} of {n}; use fewer tensor-parallel ranks"
        )
    target = dst.narrow(dim, offset // n, size // n)
    copy_checked(target, read_shard(loaded, dim, start // n, size // n), name)
