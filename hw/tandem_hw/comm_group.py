"""A process group over a communicator library (HCCL or NCCL).

Every collective goes out on the calling thread's current stream of its device, which is the
worker thread that owns the device (concurrency rule 2). Buffers are the tensors' own device
memory; outputs are allocated on the same device.

Order of a call: every framework op that makes a buffer (a contiguous copy, an output) first,
then the stream handle, then the library. On NPU the handle is read through torch_npu's
``Stream.npu_stream``, which returns ``NPUStream::stream()``, and that drains torch_npu's task
queue onto the device stream (``MakeSureQueueEmpty``, torch_npu/csrc/core/npu/NPUStream.cpp).
Ops issued after the read wait in the task queue while the library enqueues straight onto the
raw stream, so a copy made after the read could land after the collective that reads it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tandem.collectives import CollectiveAborted, ReduceOp
from tandem.collectives.process_group import check_scatterable
from tandem.device import Device
from tandem_hw.comm_library import CommLibrary
from tandem_hw.launch_turns import LaunchTurns, new_owner

logger = logging.getLogger(__name__)

# The raw handle of the calling thread's current stream (aclrtStream / cudaStream_t).
StreamHandle = Callable[[], int]

# Makes a device the calling thread's current one, the way the backend's runtime binds.
DeviceBinder = Callable[[Device], None]

# Run on the calling thread before each library call (see comm_backend.thread_device_mirror).
BeforeCall = Callable[[], None]

# How long teardown waits for one communicator's destroy call.
DESTROY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class CloseFailure:
    device: Device
    error: str


class Communicators:
    """The communicators of one clique that live in this process, one per device: abort and
    close them once, and take launch turns with the other sets over the same devices."""

    def __init__(
        self,
        library: CommLibrary,
        comms: Sequence[int],
        devices: Sequence[Device],
        bind: DeviceBinder,
        turns: LaunchTurns,
        timeout_s: float,
        label: str = "",
    ) -> None:
        """``label``: how the log names this set ("rank 1 of 2 through root info")."""
        if len(comms) != len(devices):
            raise ValueError(f"{len(comms)} communicators for {len(devices)} devices")
        self._library = library
        self._comms = list(comms)
        self._devices = list(devices)
        self._bind = bind
        self._label = label
        self.turns = turns
        self.timeout_s = timeout_s
        self.owner = new_owner()
        self._lock = threading.Lock()
        self._aborted: str | None = None
        self._closed = False
        self.close_failures: list[CloseFailure] = []

    @property
    def aborted(self) -> str | None:
        return self._aborted

    def abort(self, reason: str) -> None:
        with self._lock:
            if self._aborted is not None or self._closed:
                return
            self._aborted = reason
        self.turns.release(self.owner)
        released = [self._library.abort(c) for c in self._comms]
        if not all(released):
            logger.warning(
                "%s cannot abort a communicator; ranks blocked in a collective return when the "
                "library's own timeout expires (%s)",
                self._library.name,
                reason,
            )

    def close(self) -> None:
        """Destroy every communicator, each on a thread bound to its device: HCCL reads the
        calling thread's device first in ``HcclCommDestroy`` (op_base.cc) and fails without one,
        and the executor's thread never binds one. A failure is reported and the rest are
        still destroyed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # An aborted NCCL communicator is already released; destroying it again is invalid.
            skip = self._aborted is not None and self._library.name == "nccl"
        self.turns.release(self.owner)
        if skip:
            return
        for comm, device in zip(self._comms, self._devices, strict=True):
            error = self._destroy_on_bound_thread(comm, device)
            if error is None:
                logger.info(
                    "%s: closed the communicator of %s%s",
                    self._library.name,
                    device,
                    f" ({self._label})" if self._label else "",
                )
            else:
                self.close_failures.append(CloseFailure(device, error))
                logger.error(
                    "%s: the communicator of %s was not destroyed: %s",
                    self._library.name,
                    device,
                    error,
                )
        if self.close_failures:
            logger.error(
                "%s: %d of %d communicators could not be destroyed",
                self._library.name,
                len(self.close_failures),
                len(self._comms),
            )

    def _destroy_on_bound_thread(self, comm: int, device: Device) -> str | None:
        outcome: list[str | None] = []

        def body() -> None:
            try:
                self._bind(device)
                self._library.destroy(comm)
            except Exception as exc:  # noqa: BLE001 - reported by the caller, the rest go on
                outcome.append(f"{type(exc).__name__}: {exc}")
            else:
                outcome.append(None)

        thread = threading.Thread(
            target=body, name=f"tandem-{self._library.name}-destroy-{device}", daemon=True
        )
        thread.start()
        thread.join(DESTROY_TIMEOUT_S)
        if thread.is_alive():
            return f"the destroy call did not return within {DESTROY_TIMEOUT_S} s"
        return outcome[0]


class CommGroup:
    def __init__(
        self,
        library: CommLibrary,
        comm: int,
        rank: int,
        size: int,
        stream: StreamHandle,
        communicators: Communicators,
        device: torch.device,
        before_call: BeforeCall | None = None,
    ) -> None:
        self._library = library
        self._before_call = before_call
        self._device = device
        self._comm = comm
        self._rank = rank
        self._size = size
        self._stream = stream
        self._communicators = communicators
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

    @property
    def comm(self) -> int:
        """The library's communicator handle."""
        return self._comm

    def _check_open(self) -> None:
        reason = self._communicators.aborted
        if reason is not None:
            raise CollectiveAborted(reason)

    def _launch(self, call: Callable[[int], None]) -> None:
        """``call(stream)`` in this set's turn, the stream handle read last (see the module
        docstring): every buffer the call reads or writes exists before this."""
        self._sequence += 1
        communicators = self._communicators
        with communicators.turns.turn(
            communicators.owner,
            self._sequence,
            lambda: communicators.aborted,
            communicators.timeout_s,
        ):
            if self._before_call is not None:
                self._before_call()
            call(self._stream())

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        self._check_open()
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        self._launch(
            lambda stream: self._library.all_reduce(
                buf.data_ptr(), buf.data_ptr(), buf.numel(), buf.dtype, op, self._comm, stream
            )
        )
        if buf is not tensor:
            tensor.copy_(buf)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        self._check_open()
        src = tensor.contiguous()
        out = torch.empty((self._size, *src.shape), dtype=src.dtype, device=src.device)
        self._launch(
            lambda stream: self._library.all_gather(
                src.data_ptr(), out.data_ptr(), src.numel(), src.dtype, self._comm, stream
            )
        )
        # [size, *shape] -> concatenation along ``dim``, in rank order.
        return torch.cat(out.unbind(0), dim=dim)

    def reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        check_scatterable(tensor, self._size)
        self._check_open()
        src = tensor.contiguous()
        out = torch.empty(
            (src.shape[0] // self._size, *src.shape[1:]), dtype=src.dtype, device=src.device
        )
        self._launch(
            lambda stream: self._library.reduce_scatter(
                src.data_ptr(), out.data_ptr(), out.numel(), src.dtype, op, self._comm, stream
            )
        )
        return out

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        if not 0 <= root < self._size:
            raise ValueError(f"broadcast root {root} is outside a group of {self._size}")
        self._check_open()
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        self._launch(
            lambda stream: self._library.broadcast(
                buf.data_ptr(), buf.numel(), buf.dtype, root, self._comm, stream
            )
        )
        if buf is not tensor:
            tensor.copy_(buf)
        return tensor

    def barrier(self) -> None:
        if self._library.has_barrier:
            self._check_open()
            self._launch(lambda stream: self._library.barrier(self._comm, stream))
            return
        # NCCL has no barrier: one element reduced across ranks is one.
        token = torch.zeros(1, dtype=torch.float32, device=self._device)
        self.all_reduce(token)
