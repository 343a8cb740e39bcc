"""What a process group needs from a communicator library (HCCL or NCCL), in one shape.

Handles are plain integers (the C pointer values); buffers are device pointers taken from
tensors; every call is queued on the stream handle it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from tandem.collectives import CollectiveError, ReduceOp
from tandem_hw.ctypes_library import BoundLibrary, CFunction, bind_library


class CommLibraryError(CollectiveError):
    """A library call returned an error; the message is the library's own."""

    def __init__(self, function: str, code: int, message: str) -> None:
        super().__init__(f"{function} failed: {message} (code {code})")
        self.function = function
        self.code = code
        self.library_message = message


class CommLibrary(Protocol):
    name: str
    # Where the library was loaded from.
    path: str
    # True for the CPU stand-in built by the tests: the only library that takes host memory.
    is_standin: bool
    # HcclBarrier exists; NCCL has none (the group reduces one element instead).
    has_barrier: bool
    # The CPU stand-in's copy of the device runtime's per-thread setter (aclrtSetDevice) for
    # libraries that read the calling thread's device; None for a real library, whose runtime
    # the framework's own set_device reaches.
    host_set_device: Callable[[int], None] | None

    def init_all(self, devices: Sequence[int]) -> list[int]:
        """One communicator per device, created by one call (all ranks in this process)."""
        ...

    def unique_id(self) -> bytes:
        """A fresh communicator id (root info) for ``init_rank``, made on rank 0."""
        ...

    def init_rank(self, nranks: int, unique_id: bytes, rank: int) -> int:
        """This process's communicator of a clique named by ``unique_id``."""
        ...

    def all_reduce(
        self,
        send: int,
        recv: int,
        count: int,
        dtype: torch.dtype,
        op: ReduceOp,
        comm: int,
        stream: int,
    ) -> None: ...

    def all_gather(
        self, send: int, recv: int, count: int, dtype: torch.dtype, comm: int, stream: int
    ) -> None:
        """``count`` is what each rank sends."""
        ...

    def reduce_scatter(
        self,
        send: int,
        recv: int,
        count: int,
        dtype: torch.dtype,
        op: ReduceOp,
        comm: int,
        stream: int,
    ) -> None:
        """``count`` is what each rank receives."""
        ...

    def broadcast(
        self, buf: int, count: int, dtype: torch.dtype, root: int, comm: int, stream: int
    ) -> None:
        """In place: ``root``'s buffer lands in every rank's."""
        ...

    def barrier(self, comm: int, stream: int) -> None: ...

    def destroy(self, comm: int) -> None: ...

    def abort(self, comm: int) -> bool:
        """Release ranks blocked in this communicator; False where the library cannot."""
        ...


class CheckedLibrary:
    """A bound communicator library whose calls return 0 on success; any other result raises
    with the library's own error string. The calls whose C signatures HCCL and NCCL share
    (all-reduce, all-gather, reduce-scatter, destroy) are here, by symbol name; each library
    adds the ones that differ."""

    name: str
    # The library's ``const char *(int code)`` error-string function.
    error_function: str
    # C symbols of the shared calls: all_reduce, all_gather, reduce_scatter, destroy.
    symbols: ClassVar[Mapping[str, str]]
    data_types: Mapping[torch.dtype, int]
    reduce_ops: Mapping[ReduceOp, int]

    def __init__(self, path: Path | str, functions: Sequence[CFunction]) -> None:
        self.path = str(path)
        self._lib: BoundLibrary = bind_library(path, self.name, functions)
        self.is_standin = self._lib.has_symbol("TandemStandinVersion")
        self.host_set_device: Callable[[int], None] | None = None

    def error_string(self, code: int) -> str:
        text: bytes | None = self._lib[self.error_function](code)
        return text.decode(errors="replace") if text else f"result code {code}"

    def _call(self, function: str, *args: Any) -> None:
        code = int(self._lib[function](*args))
        if code != 0:
            raise CommLibraryError(function, code, self.error_string(code))

    def _dtype(self, dtype: torch.dtype) -> int:
        try:
            return self.data_types[dtype]
        except KeyError:
            raise ValueError(f"{self.name.upper()} has no data type for {dtype}") from None

    def all_reduce(
        self,
        send: int,
        recv: int,
        count: int,
        dtype: torch.dtype,
        op: ReduceOp,
        comm: int,
        stream: int,
    ) -> None:
        self._call(
            self.symbols["all_reduce"],
            send,
            recv,
            count,
            self._dtype(dtype),
            self.reduce_ops[op],
            comm,
            stream,
        )

    def all_gather(
        self, send: int, recv: int, count: int, dtype: torch.dtype, comm: int, stream: int
    ) -> None:
        self._call(self.symbols["all_gather"], send, recv, count, self._dtype(dtype), comm, stream)

    def reduce_scatter(
        self,
        send: int,
        recv: int,
        count: int,
        dtype: torch.dtype,
        op: ReduceOp,
        comm: int,
        stream: int,
    ) -> None:
        self._call(
            self.symbols["reduce_scatter"],
            send,
            recv,
            count,
            self._dtype(dtype),
            self.reduce_ops[op],
            comm,
            stream,
        )

    def destroy(self, comm: int) -> None:
        self._call(self.symbols["destroy"], comm)
