"""One pipeline lane of a worker: a host thread that prepares a step's inputs, a stream that
runs its forward, a stager of its own, the state of the batches it runs, and (with tensor
parallelism) a communicator set of its own. Lanes share the weights, the KV cache and the
scratch allocator, nothing mutable besides.

The host stages the step's inputs into scratch memory recorded on the lane's stream, queues
the forward, and gives the scratch back at once: no synchronize between host and stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

from tandem.collectives.thread_bound import ThreadBoundGroup
from tandem.core.worker.lane_stager import LaneStager, Staged
from tandem.core.worker.worker_thread import WorkerThread
from tandem.device import BoundContext, Device, DeviceRuntime, KernelRegistry, bind_context
from tandem.device.scratch_allocator import ScratchAllocator
from tandem.device.sync import REAL_SYNC, LockLike, Promise, Sync

P = TypeVar("P")
R = TypeVar("R")


class Lane:
    def __init__(
        self,
        index: int,
        device: Device,
        runtime: DeviceRuntime,
        registry: KernelRegistry[Any],
        group: ThreadBoundGroup | None,
        allocator: ScratchAllocator,
        prepare_lock: LockLike | None,
        forward_lock: LockLike | None,
        sync: Sync = REAL_SYNC,
    ) -> None:
        self.index = index
        name = f"tandem-{device}-lane{index}"
        self.host = WorkerThread(f"{name}-host", sync)
        self.stream = runtime.new_stream(f"{name}-stream")
        self.stager = LaneStager(allocator, self.stream, sync)
        # Per-lane state of the batches this lane runs (the recommender's beams).
        self.state: dict[int, Any] = {}
        self._prepare_lock = prepare_lock
        self._forward_lock = forward_lock

        def bind() -> None:
            runtime.bind(device)
            bind_context(BoundContext(runtime, registry))
            if group is not None:
                group.bind(index)

        # Both threads of the lane own the device; the stream's also issues the collectives.
        self.host.submit(bind).result()
        self.stream.submit(bind).result()

    def run(
        self,
        prepare: Callable[[LaneStager], tuple[P, Staged | None]],
        forward: Callable[[P], R],
    ) -> Promise[R]:
        """Prepare on the host thread, forward on the stream; the result when both are done."""

        def host() -> R:
            with self._prepare_lock or contextlib.nullcontext():
                prepared, staged = prepare(self.stager)

            def on_stream() -> R:
                with self._forward_lock or contextlib.nullcontext():
                    return forward(prepared)

            done = self.stream.submit(on_stream)
            if staged is not None:
                # Recorded on the stream at staging: reused only after the forward has run.
                self.stager.release(staged)
            return done.result()

        return self.host.submit(host)

    def is_alive(self) -> bool:
        return self.host.is_alive() and self.stream.is_alive()

    def stop(self) -> None:
        self.host.stop()
        self.stream.stop()
