"""The pool handover socket under a hostile local peer,
in process. Every wait is bounded; none sleeps for a set time."""

import fcntl
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cpcache import errors
from cpcache.client.pools import hand_over
from cpcache.daemon import budget, pool_handover
from cpcache.daemon.pool_handover import PoolHandover

pytestmark = pytest.mark.timeout(60)


def until(condition, timeout_s: float = 10.0, what: str = "") -> None:
    """Wait for `condition`, looking every few ms, at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what or condition}"
        time.sleep(0.005)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def pool_fd(size: int = 4096) -> int:
    fd = os.memfd_create("pool", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


@pytest.fixture
def handover(run_dir):
    h = PoolHandover(str(run_dir / "d.sock") + pool_handover.SUFFIX)
    h.start()
    yield h
    h.close()


def address(h: PoolHandover) -> str:
    return h.path[: -len(pool_handover.SUFFIX)]


def test_tickets_are_capped_per_uid_and_the_descriptors_stay_bounded(handover):
    """The same memfd sent 1,100 times used to hold 1,100
    descriptors for 120 s."""
    fd = pool_fd()
    before = open_fds()
    tickets, refusals = [], []
    started = time.monotonic()
    retries = 0
    for _ in range(1100):
        while True:
            try:
                tickets.append(hand_over(address(handover), fd, timeout_s=5))
            except errors.ResourceExhausted as exc:
                refusals.append(str(exc))
            except errors.Unavailable:  # the refused ones' closes lag (a busy machine): as it says, retry
                retries += 1
                assert retries < 100_000
                continue
            break
    elapsed = time.monotonic() - started
    assert len(tickets) == budget.POOLS_TICKETS_PER_UID
    assert len(refusals) == 1100 - budget.POOLS_TICKETS_PER_UID and "too many pool tickets" in refusals[0]
    until(lambda: open_fds() <= before + budget.POOLS_TICKETS_PER_UID + 2, what="the refused closed")
    counted = handover.stats()
    assert counted["pool_tickets_held"] == budget.POOLS_TICKETS_PER_UID
    assert counted["pool_handover_refused_tickets"] == 1100 - budget.POOLS_TICKETS_PER_UID
    taken, _, _ = handover.take(tickets[0])  # a held ticket is good, and frees a place
    os.close(taken)
    assert hand_over(address(handover), fd)
    print(f"1,100 handovers in {elapsed:.2f}s")
    os.close(fd)


def test_unused_tickets_expire_on_a_timer_without_any_receive(handover, monkeypatch):
    monkeypatch.setattr(pool_handover, "TICKET_TTL_S", 0.2)
    fd = pool_fd()
    before = open_fds()
    ticket = hand_over(address(handover), fd)
    assert handover.tickets == 1
    until(lambda: handover.tickets == 0, what="the ticket to expire")  # nothing else happens meanwhile
    until(lambda: open_fds() <= before, what="its descriptor to be closed")
    with pytest.raises(errors.PermissionDenied, match="expired"):
        handover.take(ticket)
    os.close(fd)


EMFILE_SCRIPT = """
import os, resource, socket, sys, time
from cpcache.daemon.pool_handover import PoolHandover
from tests.unit.daemon.test_pool_handover import pool_fd, until

handover = PoolHandover(sys.argv[1])
handover.start()
client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
fd = pool_fd()
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (max(int(f) for f in os.listdir("/proc/self/fd")) + 8, hard))
filler = []
try:
    while True:
        filler.append(os.dup(0))
except OSError:
    pass
client.connect(handover.path)  # waits in the backlog: the acceptor gets EMFILE, again and again
until(lambda: handover.counters["accept_errors"] >= 3, what="accept() to fail")
for f in filler:
    os.close(f)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
client.settimeout(10)
socket.send_fds(client, [b"pool"], [fd])
assert len(client.recv(256)) == 32  # the same connection, served once descriptors were free again
print("accept errors", handover.counters["accept_errors"])
"""


def test_accept_failing_with_emfile_is_waited_out(run_dir):
    """EMFILE from accept() used to end the handover thread.
    In a process of its own: it runs out of descriptors on purpose."""
    result = subprocess.run([sys.executable, "-c", EMFILE_SCRIPT, str(run_dir / "e.sock.pools")],
                            capture_output=True, text=True, timeout=50, cwd=Path(__file__).resolve().parents[3])
    assert result.returncode == 0, result.stderr
    assert "accept errors" in result.stdout


def test_idle_connections_do_not_starve_a_real_handover(handover):
    """Connections were served one at a time, 5 s each; three
    idle ones made a real handover fail after 10 s."""
    idle = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(budget.POOLS_SERVED_PER_UID - 1)]
    for s in idle:
        s.connect(handover.path)
    fd = pool_fd()
    started = time.monotonic()
    assert hand_over(address(handover), fd, timeout_s=5)
    assert time.monotonic() - started < 1.0
    for s in idle:  # and each idle one is dropped at its deadline
        s.settimeout(budget.POOLS_DEADLINE_S + 5)
        assert s.recv(1) == b""
        s.close()
    os.close(fd)


def lingering_tcp_socket(linger_s: int = 3600) -> tuple[socket.socket, socket.socket]:
    """A connected TCP socket with unsent data, a long SO_LINGER and a
    peer that never reads: closing its last descriptor blocks that long."""
    server = socket.create_server(("127.0.0.1", 0))
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # little to fill: many such sockets are cheap
    sock.connect(server.getsockname())
    peer, _ = server.accept()
    server.close()
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    try:
        while True:
            sock.send(b"x" * 65536)
    except BlockingIOError:
        pass
    sock.setblocking(True)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, linger_s))
    return sock, peer


def reset_by_peer(peer: socket.socket, timeout_s: float = 5.0) -> bool:
    """Whether `peer`'s other end was reset (closed at once, un-lingered)
    within `timeout_s`: a lingering close sends nothing for its linger."""
    peer.settimeout(timeout_s)
    try:
        while peer.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return False


def test_a_lingering_socket_handed_over_wedges_nothing(handover):
    """Two descriptors of such a socket, then every later
    handover (so every Attach) timed out."""
    sock, peer = lingering_tcp_socket()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as attacker:
        attacker.settimeout(10)
        attacker.connect(handover.path)
        second = os.dup(sock.fileno())
        socket.send_fds(attacker, [b"pool"], [sock.fileno(), second])
        os.close(second)
        os.close(sock.detach())  # the daemon holds the last descriptors now
        assert attacker.recv(256).startswith(b"ERR")
    fd = pool_fd()
    started = time.monotonic()
    for _ in range(3):
        assert hand_over(address(handover), fd, timeout_s=5)
    assert time.monotonic() - started < 2.0
    assert reset_by_peer(peer), "the daemon's close of the socket lingered (not un-lingered)"
    assert handover._closer.pending == 0
    peer.close()
    os.close(fd)


def attack(h: PoolHandover, send) -> socket.socket:
    """A connection to `h` on which `send(attacker_end)` has queued all it
    sends before the daemon reads any of it (through the listener, the
    daemon may read and shut it between two sends): the daemon's end is
    dispatched as the acceptor does, once everything is queued."""
    attacker, daemons = socket.socketpair()
    attacker.settimeout(10)
    send(attacker)
    assert h._slots.acquire(timeout=5)
    h._dispatch(daemons)
    return attacker


def test_sockets_left_queued_unread_wedge_nothing(handover):
    """16 plain bytes, then a lingering socket in a
    second message the daemon never asked for. Closing the connection made
    the kernel drop that socket, whose close then blocked a closer thread;
    two such blocked both, 64 more filled the pending closes and accepting
    paused for every uid for good."""
    peers, attackers = [], []
    for _ in range(70):
        peers.append(queue_a_lingering_socket(handover, attackers))
    fd = pool_fd()
    started = time.monotonic()
    assert hand_over(address(handover), fd, timeout_s=5)
    elapsed = time.monotonic() - started
    assert elapsed < 2.0, elapsed
    for attacker in attackers:  # each was answered (refused) and closed
        assert attacker.recv(256).startswith(b"ERR")
        attacker.close()
    assert all(reset_by_peer(peer) for peer in peers[-3:])  # every queued socket was read and un-lingered
    until(lambda: handover._closer.pending == 0, what="no close pending")
    print(f"a handover behind 70 such connections took {elapsed:.3f}s")
    for peer in peers:
        peer.close()
    os.close(fd)


def queue_a_lingering_socket(h: PoolHandover, attackers: list[socket.socket]) -> socket.socket:
    """A connection (kept in `attackers`) with 16 plain bytes, then a second
    message carrying a lingering socket; the socket's peer is returned."""
    sock, peer = lingering_tcp_socket(0x7FFFFFFF)

    def send(attacker: socket.socket) -> None:
        attacker.sendall(b"p" * 16)
        socket.send_fds(attacker, [b"x"], [sock.fileno()])
        os.close(sock.detach())  # the daemon's descriptor, once read (or dropped), is the last

    attackers.append(attack(h, send))
    return peer


def test_every_message_left_queued_is_drained(handover):
    """Several messages queued unread, each with a lingering socket: every
    one is read and un-lingered, none left for the kernel to drop."""
    before = open_fds()
    pairs = [lingering_tcp_socket(0x7FFFFFFF) for _ in range(3)]

    def send(attacker: socket.socket) -> None:
        attacker.sendall(b"p" * 16)
        for sock, _ in pairs:
            socket.send_fds(attacker, [b"x"], [sock.fileno()])
            os.close(sock.detach())

    with attack(handover, send) as attacker:
        assert attacker.recv(256).startswith(b"ERR INVALID_ARGUMENT")
        assert attacker.recv(256) == b""  # closed once drained
    assert all(reset_by_peer(peer) for _, peer in pairs)
    assert handover._closer.pending == 0
    for _, peer in pairs:
        peer.close()
    until(lambda: open_fds() <= before, what="every received descriptor closed")


def test_a_uid_over_its_share_of_pending_closes_is_refused_alone(handover, monkeypatch):
    """Closes that block are counted per uid: only that uid is refused."""
    me = os.getuid()
    blocked = handover._closer
    monkeypatch.setattr(blocked, "pending_for", lambda uid: budget.POOLS_PENDING_CLOSES_PER_UID if uid == me else 0)
    fd = pool_fd()
    with pytest.raises(errors.Unavailable, match="too many handovers"):
        hand_over(address(handover), fd, timeout_s=5)
    assert handover.stats()["pool_handover_refused_closes"] == 1
    monkeypatch.setattr(blocked, "pending_for", lambda uid: 0 if uid == me else budget.POOLS_PENDING_CLOSES_PER_UID)
    assert hand_over(address(handover), fd, timeout_s=5)  # another uid's blocked closes keep nobody else out
    os.close(fd)


@pytest.mark.parametrize("kind", ["pipe", "tcp", "plain", "hugetlb"])
def test_only_shmem_files_are_kept(handover, kind, tmp_path):
    if kind == "plain":
        fd = os.open(tmp_path / "pool", os.O_RDWR | os.O_CREAT, 0o600)
    elif kind == "pipe":
        fd, other = os.pipe()
        os.close(other)
    elif kind == "tcp":
        fd = socket.socket().detach()
    else:
        try:
            fd = os.memfd_create("huge", os.MFD_HUGETLB)
        except OSError as exc:
            pytest.skip(f"no hugetlbfs here: {exc}")
    before = open_fds()
    with pytest.raises(errors.FailedPrecondition, match="refused the pool: attach: .*(memfd|hugetlbfs)"):
        hand_over(address(handover), fd)
    assert handover.tickets == 0
    os.close(fd)
    until(lambda: open_fds() < before, what="the refused descriptor closed")
