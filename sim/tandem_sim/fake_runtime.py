"""A fake device runtime with the NPU's sharp edges, for the simulator's scenarios: a second
registration of one function on one device fails with 507028, a launch through a missing
stub fails as "Kernel stub is null", and (optionally) a kernel's first load takes time, as
a JIT compile does."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from tandem.device import Device, MemoryInfo
from tandem.device.sync import Sync
from tandem.device.task_thread import TaskThread
from tandem_sim.triton_casts import round_like_compiled_triton

logger = logging.getLogger(__name__)

ACL_ERROR_RT_KERNEL_DUPLICATE = 507028
# Devices the fake NPU box has (a 910B server's eight).
DEVICE_COUNT = 8


class RuntimeFault(RuntimeError):
    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class FakeNpuRuntime:
    """Per thread, the runtime's context device (what ``aclrtSetDevice`` sets) and the
    framework's cached current device (what ``torch.npu.set_device`` keeps in sync with it).
    It is also a ``DeviceRuntime``, so real workers can be bound to it; tensors stay in host
    memory, standing in for device memory."""

    kind = "npu"

    def __init__(
        self,
        sync: Sync,
        compile_s: float = 0.0,
        kernel_families: tuple[str, ...] = (),
        memory: MemoryInfo | None = None,
    ) -> None:
        """``compile_s``: virtual seconds a kernel's first load spends compiling before it
        registers (triton kernels are compiled on first use, in seconds on an NPU): the
        thread is away that long, and others run meanwhile. ``kernel_families``: what the
        fake launches besides the torch references, as ``NpuRuntime`` lists them: ``triton``
        runs the Triton kernels under Triton's interpreter (the tensors are in host memory),
        ``torch_npu`` the fused ops of whatever ``torch_npu`` imports as (the stand-in,
        ``tandem_sim.torch_npu_standin``, in place through ``tandem_sim.npu_standin``)."""
        self._sync = sync
        self.compile_s = compile_s
        self.kernel_families = kernel_families
        # What each device reports: its share of host memory where tensors really live.
        self.memory = memory or MemoryInfo(total_bytes=64 << 30, free_bytes=60 << 30)
        # Triton's interpreter runs one kernel at a time per process: it patches
        # triton.language for the launch and keeps the grid index in one module-level builder
        # (triton/runtime/interpreter.py). Two workers' launches take turns here, as two
        # devices' kernels would run side by side on hardware.
        self._interpreter = sync.lock() if "triton" in kernel_families else None
        if "triton" in kernel_families:
            round_like_compiled_triton()
        self.registered: dict[tuple[str, int], str] = {}
        # What each registration loaded: the kernel object itself (a Triton kernel's wrapper,
        # a torch reference), as a real runtime would load its binary.
        self.loaded: dict[tuple[str, int], Callable[..., Any]] = {}
        self.registrations = 0
        self._context: dict[int, int] = {}
        self._framework: dict[int, int] = {}
        # Each device's default stream, in order: a launch runs when issued, so a stream's
        # work completes in launch order; the log lets scenarios check that order.
        self.stream_log: dict[int, list[str]] = {}

    def raw_set_device(self, device: int) -> None:
        """``aclrtSetDevice``: the context moves, the framework's cache does not."""
        self._sync.yield_point(f"aclrtSetDevice {device}")
        self._context[threading.get_ident()] = device

    def framework_set_device(self, device: int) -> None:
        """``torch.npu.set_device``: both move together."""
        self._sync.yield_point(f"torch.npu.set_device {device}")
        self._context[threading.get_ident()] = device
        self._framework[threading.get_ident()] = device

    def current_stream(self) -> int:
        """The framework's current stream lives on the device it believes is current."""
        return self._framework.get(threading.get_ident(), 0)

    def launch_on_stream(self, stream_device: int) -> None:
        self._sync.yield_point("rtKernelLaunch")
        context = self._context.get(threading.get_ident(), 0)
        if stream_device != context:
            raise RuntimeFault(
                f"stale device: the stream belongs to device {stream_device} but the thread's "
                f"context is device {context} (bound with a raw runtime call?)"
            )

    def register_function(self, name: str, device: int) -> str:
        self._sync.yield_point(f"rtFunctionRegister {name}@{device}")
        if (name, device) in self.registered:
            raise RuntimeFault(
                f"rtFunctionRegister failed for kernel '{name}': "
                f"error={ACL_ERROR_RT_KERNEL_DUPLICATE}",
                ACL_ERROR_RT_KERNEL_DUPLICATE,
            )
        self.registrations += 1
        stub = f"stub:{name}@{device}"
        self.registered[(name, device)] = stub
        return stub

    # -- the DeviceRuntime interface --------------------------------------------------

    def bind(self, device: Device) -> None:
        self.framework_set_device(device.index)

    def current_device(self) -> Device | None:
        index = self._framework.get(threading.get_ident())
        return None if index is None else Device("npu", index)

    def torch_device(self, device: Device) -> torch.device:
        return torch.device("cpu")

    def synchronize(self) -> None:
        self._sync.yield_point("aclrtSynchronizeStream")

    def memory_info(self, device: Device) -> MemoryInfo:
        return self.memory

    def new_stream(self, name: str) -> TaskThread:
        """A side stream: an ordered executor whose thread the simulator schedules, so work
        on it interleaves with the host's at every yield point."""
        return TaskThread(name, self._sync)

    def device_count(self) -> int:
        return DEVICE_COUNT

    def load_kernel(
        self, name: str, impl: Callable[..., Any], device: Device
    ) -> Callable[..., Any]:
        self._compile()
        stub = self.register_function(name, device.index)
        self.loaded[(name, device.index)] = impl
        logger.info("registered %s on %s: %s.%s", name, device, impl.__module__, impl.__qualname__)

        def launch_then_run(*args: Any) -> Any:
            self.launch(stub)
            self.stream_log.setdefault(device.index, []).append(name)
            if self._interpreter is None:
                return impl(*args)
            with self._interpreter:
                return impl(*args)

        return launch_then_run

    def _compile(self) -> None:
        if self.compile_s <= 0:
            return
        done = self._sync.condition()
        deadline = self._sync.monotonic() + self.compile_s
        with done:
            # Nobody notifies: only the clock ends the wait.
            while self._sync.monotonic() < deadline:
                done.wait(deadline - self._sync.monotonic())

    def launch(self, stub: str | None) -> None:
        self._sync.yield_point("rtKernelLaunch")
        if stub is None:
            raise RuntimeFault("Kernel stub is null")
