"""`cpcache launch` starts every rank, prints their sockets, and stops them
all cleanly on SIGINT."""

import os
import signal
import subprocess
import sys

import pytest

from cpcache.client import Client

pytestmark = pytest.mark.timeout(90)


def test_launch_prints_sockets_and_stops_on_sigint(run_dir):
    proc = subprocess.Popen(
        [sys.executable, "-m", "cpcache.tools.cli", "launch", "--tp", "2", "--cp", "2", "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    sockets = []
    for line in proc.stdout:  # blocks on the launcher's own output, line by line
        if line.startswith("rank "):
            sockets.append(line.split("unix:", 1)[1].strip())
        if "press Ctrl-C" in line:
            break
    assert len(sockets) == 2
    for rank, socket in enumerate(sockets):
        with Client(socket, timeout_s=10) as client:
            status = client.status()
            assert status.rank == rank and list(status.domain_ranks) == [0, 1]
            assert status.state == "serving"
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, rest
    assert "exit codes [0, 0]" in rest
    assert not any(os.path.exists(s) for s in sockets)
