"""Free loopback TCP ports for processes about to start: the demo's MASTER_PORT, and every
service the tests start. Standard library only: otel_straggler/testing/services.py loads this file by
path, from an interpreter that may not have the package's dependencies.
"""
from __future__ import annotations

import random
import socket


def ephemeral_port_range() -> range:
    """The ports the kernel hands out for outgoing connections and for bind(port 0)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as limits:
            low, high = (int(value) for value in limits.read().split())
        return range(low, high + 1)
    except (OSError, ValueError):
        return range(32768, 61000)  # Linux's default


_ports_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback TCP port that is free now and stays free until its user binds it: drawn outside
    the ephemeral range, where a port from bind(0) can meanwhile become some outgoing connection's
    source port, and never handed out twice by this process."""
    ephemeral = ephemeral_port_range()
    candidates = [port for port in (range(20000, ephemeral.start), range(ephemeral.stop, 65536)) if len(port) > 100]
    for _ in range(200 if candidates else 0):
        span = random.choice(candidates)
        port = random.randrange(span.start, span.stop)
        if port in _ports_handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _ports_handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:  # no such range on this machine
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
