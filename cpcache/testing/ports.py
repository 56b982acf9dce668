"""Ports for programs that take a port number, not a listening socket.

A port the kernel picked for `bind(port 0)` comes from its ephemeral range,
the same range every outgoing connection and every other `bind(0)` draws
from (gloo's listeners, gRPC channels, HTTP clients). Between the moment a
test picks such a port and the moment the program it starts binds it
(seconds for an SGLang server), any of those may take it: the program then
fails with "address already in use". Below the ephemeral range a port is
taken only by a program that picks it on purpose; the windows where the
suite's own programs pick theirs are left out (SGLang's TCPStore port,
Mooncake's transfer engine). What is left is a race only with another
process picking ports this way (two suites at once): the probe below
catches a port already bound, not one merely handed out elsewhere.
"""

from __future__ import annotations

import logging
import random
import socket
from pathlib import Path

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
LOWEST, HIGHEST = 10000, 65535
# Windows below the ephemeral range that programs of the suite pick from by
# themselves: Mooncake's transfer engine (its handshake and data ports,
# 15000 up to 17000) and SGLang's TCPStore (`get_free_port_below_ephemeral`,
# 22000 to 29999).
PICKED_BY_OTHERS = ((15000, 17099), (22000, 29999))
# The port above each one handed out is free too: SGLang binds `port + 1`
# for its HTTP sidecar in gRPC mode.
NEIGHBOURS = 2
SMALLEST_SPAN = 1000  # smaller spans are left to the kernel's choice
_handed_out: set[int] = set()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (Linux's default)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def spans() -> list[range]:
    """The first ports of blocks outside the ephemeral range and the windows
    others pick from, in spans large enough to draw from."""
    low, high = ephemeral_range()
    out = []
    for start, end in ((LOWEST, low - 1), (high + 1, HIGHEST)):
        for taken_start, taken_end in PICKED_BY_OTHERS:
            if start <= taken_end and taken_start <= end:  # cut the window out
                if taken_start - start >= SMALLEST_SPAN:
                    out.append(range(start, taken_start - NEIGHBOURS + 1))
                start = max(start, taken_end + 1)
        if end - start + 1 >= SMALLEST_SPAN:
            out.append(range(start, end - NEIGHBOURS + 2))
    return out


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((HOST, port))
        except (OSError, OverflowError):
            return False
    return True


def free_port() -> int:
    """A port no one holds, not handed out before by this process, with its
    neighbour free as well: outside the ephemeral range and the windows
    others pick from, where the kernel's range leaves room for it."""
    usable = spans()
    if not usable:
        log.warning("the ephemeral range %s leaves no room below or above it: ports come from it", ephemeral_range())
    weights = [len(span) for span in usable]
    for _ in range(1000):
        port = random.choice(random.choices(usable, weights)[0]) if usable else _kernel_pick()
        block = range(port, port + NEIGHBOURS)
        if block[-1] <= HIGHEST and _handed_out.isdisjoint(block) and all(_bindable(p) for p in block):
            _handed_out.update(block)
            return port
    raise RuntimeError(f"no free port in {usable or 'the ephemeral range'}")


def _kernel_pick() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])
