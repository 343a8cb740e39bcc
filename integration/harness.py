"""Helpers for the end-to-end tests: the test model's spec and a handle on a server process."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from tandem.core.demo_model import tiny_spec

SPEC = tiny_spec()
MODEL_NAME = "tandem-demo"


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    base_url: str
    log: Path

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def wait_idle(self, timeout: float = 30) -> None:
        """Until nothing runs or waits and every KV block is free."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (
                self.metric("tandem:num_requests_running") == 0
                and self.metric("tandem:num_requests_waiting") == 0
                and self.metric("tandem:kv_cache_usage_perc") == 0
            ):
                return
            time.sleep(0.1)
        raise AssertionError("the server did not become idle with every KV block free")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


ServerFactory = Callable[..., "Server"]
