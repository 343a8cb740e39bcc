"""Shared checks for the torch_npu stand-in: every refusal names the rule and the document it
comes from.

The real library raises ``RuntimeError`` for every refused argument; the stand-in's errors are
``RuntimeError`` too, and also ``TypeError`` (a wrong dtype or Python type) or ``ValueError``
(a wrong shape or value), so a caller written against either convention catches them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
HALVES = (torch.float16, torch.bfloat16)


class NpuDtypeError(RuntimeError, TypeError):
    """A tensor's dtype (or an argument's Python type) the documentation does not allow."""


class NpuValueError(RuntimeError, ValueError):
    """A shape, rank, layout or value the documentation does not allow."""


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def require_dtype(
    op: str, arg: str, t: torch.Tensor, allowed: Sequence[torch.dtype], doc: str
) -> None:
    if t.dtype not in allowed:
        names = ", ".join(_name(d) for d in allowed)
        raise NpuDtypeError(f"{op}: {arg} must be {names}, got {_name(t.dtype)} ({doc})")


def require_same_dtype(op: str, tensors: dict[str, torch.Tensor], doc: str) -> None:
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        got = ", ".join(f"{n}={_name(d)}" for n, d in dtypes.items())
        raise NpuDtypeError(f"{op}: these must share one dtype, got {got} ({doc})")


def require_rank(op: str, arg: str, t: torch.Tensor, ranks: Iterable[int], doc: str) -> None:
    allowed = tuple(ranks)
    if t.dim() not in allowed:
        want = " or ".join(str(r) for r in allowed)
        raise NpuValueError(
            f"{op}: {arg} must have {want} dimensions, got shape {tuple(t.shape)} ({doc})"
        )


def require_shape(op: str, arg: str, t: torch.Tensor, shape: Sequence[int], doc: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise NpuValueError(
            f"{op}: {arg} must have shape {tuple(shape)}, got {tuple(t.shape)} ({doc})"
        )


def require_contiguous(op: str, arg: str, t: torch.Tensor, doc: str) -> None:
    if not t.is_contiguous():
        raise NpuValueError(f"{op}: {arg} must be contiguous (non-contiguous unsupported; {doc})")


def require(cond: bool, op: str, rule: str, doc: str) -> None:
    if not cond:
        raise NpuValueError(f"{op}: {rule} ({doc})")


def require_tensor(op: str, arg: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise NpuDtypeError(f"{op}: {arg} must be a Tensor, got {type(t).__name__}")
    return t


def require_int(op: str, arg: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise NpuDtypeError(f"{op}: {arg} must be an int, got {type(v).__name__}")
    return v


def same_device(op: str, tensors: dict[str, torch.Tensor | None]) -> None:
    """CPU tensors stand in for NPU memory; what the stand-in refuses is a mix of device types
    (a CUDA tensor next to a CPU one), which the real library refuses too."""
    kinds = {name: t.device.type for name, t in tensors.items() if t is not None}
    if len(set(kinds.values())) > 1:
        got = ", ".join(f"{n} on {k}" for n, k in kinds.items())
        raise NpuValueError(f"{op}: all device tensors must be on one device, got {got}")


def host_int_list(op: str, arg: str, v: object) -> list[int]:
    """A ``SymInt[]``/``List[int]`` argument (a list, tuple or 1-D integer tensor)."""
    if isinstance(v, torch.Tensor):
        if v.dim() != 1 or v.dtype.is_floating_point or v.dtype == torch.bool:
            raise NpuDtypeError(f"{op}: {arg} must be a list of ints or a 1-D integer tensor")
        return [int(x) for x in v.tolist()]
    if isinstance(v, (list, tuple)) and all(
        isinstance(x, int) and not isinstance(x, bool) for x in v
    ):
        return [int(x) for x in v]
    raise NpuDtypeError(f"{op}: {arg} must be a list of ints, got {type(v).__name__}")


def not_implemented(op: str, what: str) -> NotImplementedError:
    return NotImplementedError(
        f"{op}: {what} is documented for torch_npu but not implemented by the CPU stand-in"
    )
