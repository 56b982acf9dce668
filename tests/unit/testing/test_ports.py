"""Ports handed to programs that bind them later."""

import socket

import pytest

from cpcache.testing import ports

pytestmark = pytest.mark.timeout(30)


def test_ports_come_from_outside_the_kernels_own_range_with_a_free_neighbour():
    low, high = ports.ephemeral_range()
    handed = [ports.free_port() for _ in range(50)]
    assert len(set(handed)) == 50
    for port in handed:
        assert not low <= port <= high
        for taken in (port, port + 1):
            with socket.socket() as probe:
                probe.bind((ports.HOST, taken))  # free still


def test_a_port_held_by_someone_is_never_handed_out(monkeypatch):
    with socket.socket() as holder:
        holder.bind((ports.HOST, 0))
        held = holder.getsockname()[1]
        monkeypatch.setattr(ports.random, "randint", lambda start, end: held)
        with pytest.raises(RuntimeError, match="no free port"):
            ports.free_port()
