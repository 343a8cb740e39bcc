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

from tandem.server.bench.ports import ephemeral_range, free_port, listens_on

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


def test_free_ports_lie_below_the_range_outgoing_connections_take_theirs_from() -> None:
    """A client's source port can never be the one a master is about to bind."""
    low, _ = ephemeral_range()
    ports = {free_port() for _ in range(50)}
    assert all(port < low for port in ports), sorted(ports)
    assert len(ports) > 40  # drawn at random: parallel callers rarely meet
    for port in list(ports)[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
