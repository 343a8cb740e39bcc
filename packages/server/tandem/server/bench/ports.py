"""Ports for servers that tests and benchmarks start, and how to know the one answering is
theirs.

A free port is only free when asked: between ``free_port`` closing its probe socket and the
server binding the port, another server started meanwhile (a parallel test) can take it.
The late server then fails to bind and exits, but until it does, the port already answers
``/health``: the other server's. So a starter waits for its own process to hold the port
(``listens_on``) as well as for ``/health``.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path


def free_port() -> int:
    """A loopback TCP port nothing listened on a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listens_on(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a socket listening on TCP ``port`` (Linux: the
    listening socket's inode in /proc/net/tcp among the process's open files). True where
    /proc cannot tell (elsewhere than Linux): ``/health`` alone decides there."""
    table = Path("/proc/net/tcp")
    if not table.is_file():
        return True
    inodes = set()
    for line in table.read_text().splitlines()[1:]:
        fields = line.split()
        # local address "ADDR:PORT" in hex; state 0A = LISTEN; field 9 = the socket's inode.
        if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
            inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return False
    fds = Path(f"/proc/{pid}/fd")
    try:
        names = os.listdir(fds)
    except OSError:
        return False
    for name in names:
        try:
            if os.readlink(fds / name) in inodes:
                return True
        except OSError:
            continue
    return False
