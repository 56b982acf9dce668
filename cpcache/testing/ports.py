"""Ports for programs that take a port number, not a listening socket.

A port the kernel picked for `bind(port 0)` comes from its ephemeral range,
the same range every outgoing connection and every other `bind(0)` draws
from (gloo's listeners, gRPC channels, HTTP clients). Between the moment a
test picks such a port and the moment the program it starts binds it
(seconds for an SGLang server), any of those may take it: the program then
fails with "address already in use". Ports below the ephemeral range are
only ever taken by a program that names them, so a free one stays free.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

HOST = "127.0.0.1"
LOWEST = 10000
# The port above each one handed out is free too: SGLang binds `port + 1`
# for its HTTP sidecar in gRPC mode.
NEIGHBOURS = 2
_handed_out: set[int] = set()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (Linux's default)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port no one holds, outside the ephemeral range where there is room,
    not handed out before by this process, with its neighbour free as well."""
    low, high = ephemeral_range()
    spans = [(LOWEST, low - NEIGHBOURS), (high + 1, 65535 - NEIGHBOURS)]
    start, end = max(spans, key=lambda span: span[1] - span[0])
    for _ in range(1000):
        port = random.randint(start, end) if end - start > 1000 else _kernel_pick()
        block = range(port, port + NEIGHBOURS)
        if _handed_out.isdisjoint(block) and all(_bindable(p) for p in block):
            _handed_out.update(block)
            return port
    raise RuntimeError(f"no free port between {start} and {end}")


def _kernel_pick() -> int:
    # Only where the ephemeral range leaves no room outside it.
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])
