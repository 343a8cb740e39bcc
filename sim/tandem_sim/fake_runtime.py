"""A fake device runtime with the NPU's sharp edges, for the simulator's scenarios: a second
registration of one function on one device fails with 507028, and a launch through a missing
stub fails as "Kernel stub is null"."""

from __future__ import annotations

from tandem.device.sync import Sync

ACL_ERROR_RT_KERNEL_DUPLICATE = 507028


class RuntimeFault(RuntimeError):
    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class FakeNpuRuntime:
    def __init__(self, sync: Sync) -> None:
        self._sync = sync
        self.registered: dict[tuple[str, int], str] = {}
        self.registrations = 0

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

    def launch(self, stub: str | None) -> None:
        self._sync.yield_point("rtKernelLaunch")
        if stub is None:
            raise RuntimeFault("Kernel stub is null")
