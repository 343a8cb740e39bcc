"""A device runtime over one of torch's accelerator modules (torch.npu, torch.cuda).

Binding goes through the framework's own setter (``set_device``), never a raw runtime call, so
the framework's thread-local device cache and the thread's streams agree (concurrency rule 1).
"""

from __future__ import annotations

import itertools
import re
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from tandem.device import Device, MemoryInfo
from tandem.device.sync import Promise

T = TypeVar("T")


def parse_visible_devices(value: str | None) -> list[int] | None:
    """The physical ids ``CUDA_VISIBLE_DEVICES`` exposes, in order; None when unset."""
    if value is None or not value.strip():
        return None
    try:
        return [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise ValueError(
            f"visible-devices list {value!r} must be comma-separated integers"
        ) from None


@dataclass(frozen=True)
class AscendVisible:
    """``ASCEND_RT_VISIBLE_DEVICES`` as the CANN runtime reads it (CANN environment-variable
    reference, ASCEND_RT_VISIBLE_DEVICES): comma-separated logical ids; reading stops at the
    first character that is not a digit or a comma, and only the ids before it count ("1, 2,3"
    is device 1 alone); only ascending lists are supported, and one that does not ascend
    leaves the process no device."""

    # The ids as listed (up to where reading stopped), and the ones the process gets.
    listed: list[int]
    ids: list[int]
    # The part of the value the runtime reads; shorter than the value when it stopped early.
    read: str

    @property
    def ascending(self) -> bool:
        return all(a < b for a, b in itertools.pairwise(self.listed))


def parse_ascend_visible_devices(value: str | None) -> AscendVisible | None:
    if value is None or not value.strip():
        return None
    read = re.match(r"[0-9,]*", value)
    assert read is not None  # the pattern matches the empty prefix at least
    listed: list[int] = []
    for field in read.group().split(","):
        if not field:
            break
        listed.append(int(field))
    ascending = all(a < b for a, b in itertools.pairwise(listed))
    return AscendVisible(listed, listed if ascending else [], read.group())


class AcceleratorRuntime:
    kind: str
    kernel_families: tuple[str, ...]
    # The attribute of a torch stream object that holds the raw handle.
    stream_attr: str
    # The variable that restricts (and renumbers) the devices this process sees.
    visible_env: str

    def __init__(self, module: Any, environ: dict[str, str]) -> None:
        self._module = module
        self._local = threading.local()
        # (kernel, device) -> loads: the registry promises one per key; tests on the device
        # read this to check it.
        self.kernel_loads: Counter[tuple[str, Device]] = Counter()
        self._loads_lock = threading.Lock()
        self.visible = self.visible_ids(environ.get(self.visible_env))

    def visible_ids(self, value: str | None) -> list[int] | None:
        """The ids ``visible_env`` exposes, in order; None when unset."""
        return parse_visible_devices(value)

    def _check(self, device: Device) -> None:
        if device.kind != self.kind:
            raise ValueError(f"the {self.kind} runtime cannot bind {device}")
        count = self.device_count()
        if device.index >= count:
            shown = (
                f" ({self.visible_env}={','.join(map(str, self.visible))})" if self.visible else ""
            )
            raise ValueError(
                f"{device} does not exist: this process sees {count} {self.kind} device(s){shown}; "
                f"indices in --devices are logical, counted after {self.visible_env}"
            )

    def bind(self, device: Device) -> None:
        self._check(device)
        self._module.set_device(device.index)
        self._local.device = device

    def torch_device(self, device: Device) -> torch.device:
        return torch.device(self.kind, device.index)

    def current_device(self) -> Device | None:
        device: Device | None = getattr(self._local, "device", None)
        if device is None:
            return None
        framework = int(self._module.current_device())
        if framework != device.index:
            raise RuntimeError(
                f"this thread bound {device} but torch reports {self.kind}:{framework}: something "
                "changed the device behind the framework's back"
            )
        return device

    def current_stream(self) -> Any:
        return self._module.current_stream()

    def stream_handle(self, stream: Any = None) -> int:
        """The raw runtime handle (aclrtStream / cudaStream_t) of ``stream`` or the current one."""
        target = stream if stream is not None else self.current_stream()
        return int(getattr(target, self.stream_attr))

    def new_stream(self, name: str) -> TorchStream:
        """A side stream on the calling thread's device."""
        return TorchStream(self._module, self._module.Stream(), name)

    def new_event(self) -> Any:
        return self._module.Event()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the caching allocator that ``stream`` still uses ``tensor``'s memory."""
        tensor.record_stream(stream)

    def synchronize(self) -> None:
        self._module.synchronize()

    def memory_info(self, device: Device) -> MemoryInfo:
        free, total = self._module.mem_get_info(device.index)
        return MemoryInfo(total_bytes=int(total), free_bytes=int(free))

    def device_count(self) -> int:
        return int(self._module.device_count())

    def load_kernel(
        self, name: str, impl: Callable[..., Any], device: Device
    ) -> Callable[..., Any]:
        # The model's kernels are torch operators dispatched by the framework's own op
        # registry; the kernel registry still guarantees one first use per (kernel, device).
        with self._loads_lock:
            self.kernel_loads[(name, device)] += 1
        return impl


class _TorchEvent:
    def __init__(self, event: Any) -> None:
        self._event = event

    def done(self) -> bool:
        return bool(self._event.query())


class TorchStream:
    """A device stream: ``submit`` launches the work on it from the calling thread and returns
    once the stream has finished it (the caller needs the sampled tokens on the host anyway);
    events let the scratch allocator reuse memory without a full synchronize."""

    def __init__(self, module: Any, stream: Any, name: str) -> None:
        self._module = module
        self.stream = stream
        self.name = name

    def submit(self, fn: Callable[[], T]) -> Promise[T]:
        promise: Promise[T] = Promise()
        try:
            with self._module.stream(self.stream):
                result = fn()
            self.stream.synchronize()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the promise
            promise.set_exception(exc)
        else:
            promise.set_result(result)
        return promise

    def record_event(self) -> _TorchEvent:
        event = self._module.Event()
        event.record(self.stream)
        return _TorchEvent(event)

    def is_alive(self) -> bool:
        return True

    def stop(self) -> None:
        """Nothing to stop: the stream belongs to the framework."""
