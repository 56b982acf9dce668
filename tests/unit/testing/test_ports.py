"""Ports handed to programs that bind them later."""

import socket

import pytest

from cpcache.testing import ports

pytestmark = pytest.mark.timeout(30)

LINUX_DEFAULT = (32768, 60999)


@pytest.fixture
def linux_default(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: LINUX_DEFAULT)


def test_ports_come_from_outside_the_kernels_range_and_others_windows_with_a_free_neighbour(linux_default):
    handed = [ports.free_port() for _ in range(200)]
    assert len(set(handed)) == 200
    for port in handed:
        assert port + 1 < LINUX_DEFAULT[0] or port > LINUX_DEFAULT[1]
        assert not any(low <= p <= high for low, high in ports.PICKED_BY_OTHERS for p in (port, port + 1))
        for taken in (port, port + 1):
            with socket.socket() as probe:
                probe.bind((ports.HOST, taken))  # free still


def test_the_spans_leave_out_sglangs_and_mooncakes_windows(linux_default):
    first_ports = {p for span in ports.spans() for p in (span[0], span[-1])}
    assert min(first_ports) == ports.LOWEST and max(first_ports) == ports.HIGHEST - 1
    assert all(span[-1] + ports.NEIGHBOURS - 1 < LINUX_DEFAULT[0] or span[0] > LINUX_DEFAULT[1]
               for span in ports.spans())
    for low, high in ports.PICKED_BY_OTHERS:
        assert not any(span[0] <= high and low <= span[-1] + ports.NEIGHBOURS - 1 for span in ports.spans())


def test_a_port_held_by_someone_is_never_handed_out(linux_default, monkeypatch):
    with socket.socket() as holder:
        holder.bind((ports.HOST, 0))
        held = holder.getsockname()[1]
        monkeypatch.setattr(ports.random, "choice", lambda span: held)
        with pytest.raises(RuntimeError, match="no free port"):
            ports.free_port()


def test_a_kernel_range_that_leaves_no_room_gives_its_own_ports_never_one_past_65535(monkeypatch, caplog):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    picks = iter([65535, 65535])
    real = ports._kernel_pick
    monkeypatch.setattr(ports, "_kernel_pick", lambda: next(picks, None) or real())
    port = ports.free_port()
    assert port < 65535 and "leaves no room" in caplog.text
