"""A worker process killed mid-generation: its requests fail within 10 s, the engine says so."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from harness import free_port

from tandem.core import (
    CacheConfig,
    EngineConfig,
    EngineDeadError,
    EngineLoop,
    LLMEngine,
    ModelLoadConfig,
    RequestOutput,
    SamplingParams,
)
from tandem.core.config import ParallelConfig
from tandem.core.executor.process_executor import ProcessExecutor


def test_killed_worker_fails_requests_quickly(model_dir: Path) -> None:
    engine = LLMEngine(
        EngineConfig(
            model=ModelLoadConfig(model=str(model_dir)),
            cache=CacheConfig(num_blocks=256),
            parallel=ParallelConfig(
                devices="cpu:0,cpu:1", master_node_addr=f"127.0.0.1:{free_port()}"
            ),
        )
    )
    executor = engine.executor
    assert isinstance(executor, ProcessExecutor)
    loop = EngineLoop(engine)
    finished: dict[str, RequestOutput] = {}
    started = threading.Event()
    done = threading.Event()

    def collect(out: RequestOutput) -> None:
        started.set()
        if out.finished:
            finished[out.request_id] = out
            if len(finished) == 2:
                done.set()

    try:
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        loop.submit("hello", params, collect, request_id="a")
        loop.submit("world", params, collect, request_id="b")
        assert started.wait(60)
        victim = executor._procs[1]
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        assert done.wait(10), "requests still pending 10 s after the worker died"
        assert time.monotonic() - killed_at < 10
        assert {o.finish_reason for o in finished.values()} == {"error"}
        assert all("rank 1 (cpu:1)" in (o.error or "") for o in finished.values())
        assert engine.dead is not None and not loop.is_alive
        # What /health consults besides the loop: the executor knows a worker is gone.
        with pytest.raises(EngineDeadError, match="rank 1"):
            executor.check_health()
    finally:
        loop.stop()
