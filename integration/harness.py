"""Helpers for the end-to-end tests: the test model's spec and a handle on a server process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx
import httpx2
import preloaded_cli
from openai import AsyncOpenAI, OpenAI

from tandem.core.demo.demo_model import tiny_spec
from tandem.server.bench.ports import free_port as free_port  # re-exported for the tests

SPEC = tiny_spec()
MODEL_NAME = "tandem-demo"
# The server closes a connection idle for its keep-alive timeout (5 s); httpx's pool reuses
# one idle for up to its own expiry, also 5 s by default, so a request can go out on a
# connection the server is closing at that instant ("Server disconnected without sending a
# response"). Clients that do not retry (the tests' do not, so no failure hides) must drop
# idle connections well before the server does, as any client talking to a keep-alive
# server should. (openai 3 talks through httpx2, its own fork of httpx.)
CLIENT_KEEPALIVE_EXPIRY_S = 2.0


def openai_client(base_url: str) -> OpenAI:
    """The official client on ``{base_url}/v1``, without retries."""
    http = httpx2.Client(limits=httpx2.Limits(keepalive_expiry=CLIENT_KEEPALIVE_EXPIRY_S))
    return OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, http_client=http)


def async_openai_client(base_url: str) -> AsyncOpenAI:
    """The official asyncio client on ``{base_url}/v1``, without retries."""
    http = httpx2.AsyncClient(limits=httpx2.Limits(keepalive_expiry=CLIENT_KEEPALIVE_EXPIRY_S))
    return AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, http_client=http)


class ServerProcess(Protocol):
    """What the tests use of a server's process: a real one (``subprocess.Popen``) or a child
    of the fork server (``preloaded_cli.ForkedProcess``)."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


@dataclass
class Server:
    process: ServerProcess
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


ServerFactory = Callable[..., "Server"]


# Prompts of different lengths, given as token ids so every model reads the same ones.
PROMPT_IDS = ["1,45,300,21", "7", "3,9,27,81,243,11,33,99,297,2,6,18,54,162,86,258,4,12,36,108"]


def topology_args(
    topology: str, port: int, kind: str = "cpu"
) -> tuple[list[list[str]], dict[str, str]]:
    """The extra ``tandem generate`` arguments of each node, and the environment, for a named
    topology: tp1, tp2-single-process, tp2-multi-process, tp4-2nodes-single-process."""
    addr = f"127.0.0.1:{port}"
    pair = f"{kind}:0,{kind}:1"
    if topology == "tp1":
        return [["--devices", f"{kind}:0"]], {}
    if topology == "tp2-single-process":
        return [["--devices", pair]], {"TANDEM_ENABLE_SINGLE_PROCESS": "1"}
    if topology == "tp2-multi-process":
        return [["--devices", pair, "--master-node-addr", addr]], {}
    if topology == "tp4-2nodes-single-process":
        shared = ["--devices", pair, "--nnodes", "2", "--master-node-addr", addr]
        nodes = [[*shared, "--node-rank", "0"], [*shared, "--node-rank", "1"]]
        return nodes, {"TANDEM_ENABLE_SINGLE_PROCESS": "1"}
    raise ValueError(f"unknown topology {topology!r}")


@dataclass
class Generated:
    token_ids: list[list[int]]
    # Every node's stderr, in node order.
    logs: list[str]
    # Per prompt, its tokens taken from the prefix cache.
    num_cached_tokens: list[int]


def generate_token_ids(
    model: Path,
    topology: str,
    new_tokens: int,
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    log_level: str = "WARNING",
    kind: str = "cpu",
    prompts: list[str] | None = None,
) -> Generated:
    """Greedy token ids of ``prompts`` (comma-separated token ids; default ``PROMPT_IDS``)
    from ``tandem generate`` processes (one per node)."""
    prompts = PROMPT_IDS if prompts is None else prompts
    base = [sys.executable, "-m", "tandem.server.cli.main", "generate", "--log-level", log_level,
            "--model", str(model), "--num-blocks", "256", "--max-tokens", str(new_tokens),
            "--ignore-eos", "--json", *extra]  # fmt: skip
    for prompt in prompts:
        base += ["--prompt-token-ids", prompt]
    nodes, topo_env = topology_args(topology, free_port(), kind)
    full_env = {**os.environ, **topo_env, **(env or {})}
    runs: list[Run]
    if env is None:
        # The topology's switches are read at run time: the nodes can be children of the
        # preloaded fork server (preloaded_cli says why).
        runs = [preloaded_cli.start(base[3:] + node, full_env) for node in nodes]
    else:
        runs = [
            PopenRun(subprocess.Popen(base + node, env=full_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
            for node in nodes
        ]  # fmt: skip
    outputs = finish_all(runs, timeout_s=240)
    for run, (_, err) in zip(runs, outputs, strict=True):
        assert run.returncode == 0, err[-3000:]
    records = [json.loads(line) for line in outputs[0][0].splitlines()]
    assert len(records) == len(prompts)
    assert all(len(r["token_ids"]) == new_tokens for r in records)
    return Generated(
        [r["token_ids"] for r in records],
        [err for _, err in outputs],
        [r["num_cached_tokens"] for r in records],
    )


class Run(Protocol):
    """A started node process: a real one (``PopenRun``) or a child of the fork server
    (``preloaded_cli.CliProcess``)."""

    @property
    def returncode(self) -> int | None: ...

    def finish(self, timeout_s: float) -> tuple[str, str] | None: ...

    def kill(self) -> tuple[str, str]: ...


@dataclass
class PopenRun:
    """A real process as a ``Run``."""

    process: subprocess.Popen[str]

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def finish(self, timeout_s: float) -> tuple[str, str] | None:
        try:
            return self.process.communicate(timeout=max(timeout_s, 0.1))
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> tuple[str, str]:
        self.process.kill()
        return self.process.communicate()


def finish_all(runs: Sequence[Run], timeout_s: float) -> list[tuple[str, str]]:
    """Each process's (stdout, stderr) once all have exited. Past ``timeout_s`` in all they
    are killed and the failure carries every one's last log lines: a hang under load must
    say where each process was, not only that time ran out."""
    deadline = time.monotonic() + timeout_s
    outputs: list[tuple[str, str]] = []
    for run in runs:
        finished = run.finish(deadline - time.monotonic())
        if finished is None:
            outputs += [r.kill() for r in runs[len(outputs) :]]
            tails = [f"process {i}: {err[-3000:]}" for i, (_, err) in enumerate(outputs)]
            raise AssertionError(
                f"not done within {timeout_s:.0f} s; their last log lines:\n" + "\n".join(tails)
            ) from None
        outputs.append(finished)
    return outputs


def write_plugin_distribution(root: Path, module: str, source: str, entry_points: str) -> Path:
    """A site folder holding one module and the dist-info that declares its entry points, as
    an installed test-only package would be; put the folder on PYTHONPATH to install it."""
    site = root / "site"
    (site / module).mkdir(parents=True)
    (site / module / "__init__.py").write_text(source)
    info = site / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text(entry_points)
    return site
