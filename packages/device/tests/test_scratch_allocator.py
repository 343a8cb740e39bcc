"""The scratch allocator's stream semantics with real ordered executors (streams)."""

from __future__ import annotations

import threading

import torch

from tandem.device.scratch_allocator import ScratchAllocator
from tandem.device.task_thread import TaskThread


def test_a_block_recorded_on_a_busy_stream_is_not_handed_out_again() -> None:
    allocator = ScratchAllocator(torch.device("cpu"))
    stream = TaskThread("stream")
    gate = threading.Event()
    try:
        first = allocator.allocate(1000)
        allocator.record_stream(first, stream)
        # The stream is busy with work queued before the free.
        running = stream.submit(lambda: gate.wait(10))
        allocator.free(first)
        second = allocator.allocate(1000)
        assert second is not first and allocator.blocks_created == 2
        gate.set()
        running.result(timeout=10)
        stream.record_event().result(timeout=10)
        third = allocator.allocate(800)
        assert third is first and third.generation == 2
    finally:
        gate.set()
        stream.stop()


def test_a_block_no_stream_uses_is_reused_at_once_and_sizes_round_up() -> None:
    allocator = ScratchAllocator(torch.device("cpu"))
    block = allocator.allocate(10)
    assert block.nbytes == 512
    view = block.view(torch.int64, (2, 3))
    assert view.shape == (2, 3)
    allocator.free(block)
    assert allocator.allocate(100) is block
    # A larger request never gets a smaller block.
    allocator.free(block)
    assert allocator.allocate(4096) is not block


def test_pools_keep_blocks_apart() -> None:
    allocator = ScratchAllocator(torch.device("cpu"))
    block = allocator.allocate(64, pool="a")
    allocator.free(block)
    assert allocator.allocate(64, pool="b") is not block
    assert allocator.allocate(64, pool="a") is block
