"""The server a soak runs against: started as ``tandem serve`` in a process of its own, so its
memory (worker processes included), its threads, its metrics and its exit status can be
watched from outside."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tandem.server.bench.ports import free_port, listens_on

# What must be back to 0 once the load stops.
REST_GAUGES = (
    "tandem:num_requests_running",
    "tandem:num_requests_waiting",
    "tandem:kv_cache_usage_perc",
    "tandem:state_slot_usage_perc",
)
# The server's flags for each topology the soak knows.
TOPOLOGIES = ("tp1", "tp2-single-process", "tp2-multi-process")


def topology_flags(topology: str) -> tuple[list[str], dict[str, str]]:
    if topology == "tp1":
        return ["--devices", "cpu:0"], {}
    if topology == "tp2-single-process":
        return ["--devices", "cpu:0,cpu:1"], {"TANDEM_ENABLE_SINGLE_PROCESS": "1"}
    if topology == "tp2-multi-process":
        addr = f"127.0.0.1:{free_port()}"
        return ["--devices", "cpu:0,cpu:1", "--master-node-addr", addr], {}
    raise ValueError(f"unknown topology {topology!r}; choose from {', '.join(TOPOLOGIES)}")


@dataclass(frozen=True)
class Sample:
    """The server's process tree at one moment."""

    rss_mib: float
    threads: int
    processes: int


class SoakServer:
    def __init__(self, model: Path, topology: str, extra: list[str], log: Path) -> None:
        flags, env = topology_flags(topology)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = log
        command = [sys.executable, "-m", "tandem.server.cli.main", "serve", "--model",
                   str(model), "--port", str(self.port), *flags, *extra]  # fmt: skip
        with log.open("wb") as sink:
            self.process = subprocess.Popen(
                command, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, **env}
            )

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited at start; see {self.log}")
            try:
                # Its own /health: another server may hold the port until ours fails to bind.
                healthy = httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200
                if healthy and listens_on(self.process.pid, self.port):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"the server did not become healthy in {timeout:.0f} s; see {self.log}")

    def sample(self) -> Sample:
        """RSS of the server and every process under it, and the server's threads."""
        tree = [self.process.pid, *_descendants(self.process.pid)]
        rss = sum(_status_field(pid, "VmRSS") for pid in tree)
        return Sample(rss / 1024, _status_field(self.process.pid, "Threads"), len(tree))

    def metrics(self) -> dict[str, float]:
        figures: dict[str, float] = {}
        for line in httpx.get(f"{self.base_url}/metrics", timeout=10).text.splitlines():
            if line.startswith("#") or " " not in line:
                continue
            name, value = line.rsplit(" ", 1)
            figures[name.split("{", 1)[0]] = float(value)
        return figures

    def wait_idle(self, timeout: float) -> dict[str, float]:
        """The metrics once nothing runs or waits and no KV block is held (or at timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            figures = self.metrics()
            idle = all(figures.get(name, 0.0) == 0.0 for name in REST_GAUGES)
            if idle or time.monotonic() >= deadline:
                return figures
            time.sleep(0.2)

    def stop(self, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return -signal.SIGKILL


def _status_field(pid: int, field: str) -> int:
    """A number from /proc/PID/status (kB for sizes); 0 once the process is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _descendants(root: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(parent, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
