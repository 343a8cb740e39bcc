"""Ports for servers that tests and benchmarks start, and how to know the one answering is
theirs.

A free port is only free when asked: between ``free_port`` closing its probe socket and the
server binding the port, another server started meanwhile (a parallel test) can take it.
The late server then fails to bind and exits, but until it does, the port already answers
``/health``: the other server's. So a starter waits for its own process to hold the port
(``listens_on``) as well as for ``/health``.

Ports are drawn below the kernel's ephemeral range, not from it (``bind(0)`` would): every
outgoing connection (the suite makes thousands, to its servers) takes its source port from
that range, so a port handed out from it can be in use by a client before the process it was
meant for binds it (a torch.distributed master or an HCCL root cannot wait for it the way a
starter waits for ``/health``). Below the range, only another caller of ``free_port`` drawing
the same one of 16,384 ports in that moment can.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

# How many ports below the ephemeral range are drawn from, and the lowest one considered.
_SPAN = 16384
_LOWEST = 1024
_TRIES = 64
_RANDOM = random.SystemRandom()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of source ports for outgoing connections (Linux's default where
    /proc does not say)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A loopback TCP port nothing was bound to a moment ago, below the ephemeral range (bound
    by the kernel's choice if none there is free)."""
    low = ephemeral_range()[0]
    first = max(_LOWEST, low - _SPAN)
    for _ in range(_TRIES if low > first else 0):
        port = _RANDOM.randrange(first, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
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
