"""The SGLang backend gives device slots back once the daemon that may still
copy into them has exited: a real process serving a real unix socket,
killed, seen gone through its pidfd (no timing involved)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cpcache.integrations.sglang.daemon_process import DaemonProcess
from cpcache.integrations.sglang.quarantine import Quarantine

pytestmark = pytest.mark.timeout(60)

SERVE = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(sys.argv[1]); s.listen(8)
print("listening", flush=True)
while True:
    conn, _ = s.accept(); conn.close()
"""


@pytest.fixture
def served(tmp_path: Path):
    path = tmp_path / "rank-0.sock"
    proc = subprocess.Popen([sys.executable, "-c", SERVE, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
    yield path, proc
    proc.kill()
    proc.wait()
    proc.stdout.close()


def test_the_watched_process_is_the_one_serving_the_socket_and_its_exit_is_seen(served):
    path, proc = served
    daemon = DaemonProcess.serving(f"unix:{path}")
    assert daemon is not None and daemon.pid == proc.pid
    assert not daemon.exited()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert daemon.exited()
    daemon.close()
    assert not daemon.exited(), "a closed watch must not claim its process is gone"


def test_what_cannot_be_watched_is_unknown_never_gone(tmp_path: Path):
    assert DaemonProcess.serving("127.0.0.1:50051") is None  # TCP
    assert DaemonProcess.serving(str(tmp_path / "nobody.sock")) is None  # nothing listens


def test_quarantined_slots_are_freed_once_their_daemon_exits_or_at_attach_again(served):
    path, proc = served
    freed: list[list[int]] = []
    quarantine = Quarantine()
    watched = DaemonProcess.serving(str(path))
    quarantine.hold(torch.arange(0, 32), watched)
    quarantine.hold(torch.arange(32, 48), None)  # a daemon that cannot be watched
    assert quarantine.tokens() == 48
    assert quarantine.release_exited(lambda s: freed.append(s.tolist())) == 0 and not freed
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert quarantine.release_exited(lambda s: freed.append(s.tolist())) == 32
    assert freed == [list(range(32))] and quarantine.tokens() == 16
    assert quarantine.release_all(lambda s: freed.append(s.tolist())) == 16
    assert freed[-1] == list(range(32, 48)) and quarantine.tokens() == 0
