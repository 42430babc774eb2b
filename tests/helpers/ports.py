"""Local TCP ports for servers the tests start, chosen below Linux's ephemeral range (32768-60999).

A client that connects to a port of the ephemeral range before its server listens can be given that very
port as its own source port and connect to itself: it then reads its own request as the reply (Prefect's
health poll failed with "illegal status line: GET /api/health"). Ports below the range are never given to
clients as source ports.
"""

from __future__ import annotations

import os
import socket

_LOW, _HIGH = 20000, 32000


def free_ports(n: int = 1) -> range:
    """``n`` consecutive ports of 127.0.0.1 free now, below the ephemeral range; the scan starts at a place
    that depends on the process id, so that parallel test workers rarely try the same ports."""
    span = _HIGH - _LOW - n
    first = os.getpid() * 7919 % span
    for k in range(0, span, 97):
        start = _LOW + (first + k) % span
        try:
            for port in range(start, start + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return range(start, start + n)
    raise RuntimeError(f"no {n} consecutive free local ports in {_LOW}-{_HIGH}")


def free_port() -> int:
    """One free port of 127.0.0.1 below the ephemeral range."""
    return free_ports(1).start
