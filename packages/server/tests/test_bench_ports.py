"""A started server is known to be the one answering on its port: ``listens_on`` tells the
process that holds a listening socket from any other (the race a parallel test's server can
win between ``free_port`` and the bind)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.server.bench.ports import free_port, listens_on

pytestmark = pytest.mark.skipif(
    not Path("/proc/net/tcp").is_file(), reason="needs Linux /proc to tell sockets apart"
)


def test_only_the_process_holding_the_listening_socket_listens_on_the_port() -> None:
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            port = server.getsockname()[1]
            assert not listens_on(os.getpid(), port)  # bound, not listening yet
            server.listen()
            assert listens_on(os.getpid(), port)
            assert not listens_on(other.pid, port)
        assert not listens_on(os.getpid(), port)
        assert not listens_on(os.getpid(), free_port())
    finally:
        other.kill()
        other.wait()
