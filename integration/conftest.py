"""Fixtures: the test model, and real ``tandem serve`` processes on free loopback ports."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import preloaded_cli
import pytest
from harness import MODEL_NAME, SPEC, Server, ServerFactory, ServerProcess, free_port

from tandem.core.demo.demo_model import write_demo_model
from tandem.server.bench.ports import listens_on


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("model"), SPEC)


def _limit_files(limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))


@pytest.fixture(scope="session")
def start_server(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerFactory]:
    servers: list[Server] = []

    def start(
        *extra: str,
        demo_model: bool = True,
        env: dict[str, str] | None = None,
        nofile: int | None = None,
        real_process: bool = False,
    ) -> Server:
        """A server of the demo model (or, with ``demo_model=False``, of whatever ``extra``
        names: by default the bundled stories260k), with ``env`` added to its environment
        and, with ``nofile``, that open-file limit. A child of the preloaded fork server
        where it can be (preloaded_cli says why); ``real_process`` for the tests of how the
        process itself exits: such a child ends with ``os._exit`` after Python's exit
        handlers, so an exit that hangs or crashes in the interpreter's or a C library's
        finalization would not show there."""
        port = free_port()
        log = tmp_path_factory.mktemp("server") / "server.log"
        model = ["--model", str(model_dir), "--served-model-name", MODEL_NAME] if demo_model else []
        argv = [
            "serve",
            *model,
            "--port",
            str(port),
            "--num-blocks",
            "512",
            "--block-size",
            "16",
            "--shutdown-timeout",
            "5",
            *extra,
        ]
        full_env = {**os.environ, **(env or {})}
        process: ServerProcess
        if not real_process and nofile is None and preloaded_cli.preloadable(full_env):
            log.touch()  # there to read even if the child dies before it opens it
            process = preloaded_cli.start_logged(argv, full_env, log)
        else:
            with log.open("wb") as sink:
                process = subprocess.Popen(
                    [sys.executable, "-m", preloaded_cli.CLI, *argv],
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    env=full_env,
                    preexec_fn=None if nofile is None else lambda: _limit_files(nofile),
                )
        server = Server(process, f"http://127.0.0.1:{port}", log)
        servers.append(server)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise AssertionError(f"server exited early:\n{log.read_text()}")
            try:
                # Its own /health: another server may hold the port until ours fails to bind.
                healthy = httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200
                if healthy and listens_on(process.pid, port):
                    return server
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"server did not become healthy:\n{log.read_text()}")

    yield start
    for server in servers:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


@pytest.fixture(scope="session")
def server(start_server: ServerFactory) -> Server:
    """The shared server most tests talk to."""
    return start_server()
