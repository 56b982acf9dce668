"""A scheduler holds its daemon by the pidfd the daemon hands over on its
`.pools` socket (docs/design.md rule 12), not by a pid: it sees the daemon's
exit from another pid namespace (a container beside the daemon's), where
the pid the kernel names for the socket's peer is 0 and no pid could be
looked up, and it stops a stuck daemon it may signal, never a process that
reused its pid."""

import asyncio
import shutil
import signal
import subprocess
import sys

import pytest

from cpcache.client import Client
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.topology import Topology

pytestmark = [pytest.mark.timeout(120)]

# Runs in a pid namespace of its own: take the daemon's identity (at attach,
# while it answers), report the pid the kernel names for its socket; told
# the daemon is stuck, try to stop it (out of sight: it cannot), then see it
# exit when its service manager kills it.
SCHEDULER = """
import socket, struct, sys
from cpcache.client import Client
from cpcache.client.pools import handover_path
path = sys.argv[1]
probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
probe.connect(handover_path(path))
pid = struct.unpack("3i", probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
probe.close()
with Client(path, timeout_s=10) as client:
    held = client.identify()
    print("peer-pid", pid, "gone-before", held.process.gone(), flush=True)
    sys.stdin.readline()  # the daemon is stuck now
    print("stopped-here", held.process.stop(1), flush=True)
    print("seen-gone", held.process.wait(60), flush=True)
"""


def test_a_scheduler_in_another_pid_namespace_sees_its_daemon_exit_by_the_pidfd_it_was_handed(run_dir):
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here")
    probe = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no pid namespace can be made here: {probe.stderr.decode().strip()}")
    spec = DomainSpec(Topology(tp=1), run_dir)

    async def run():
        async with LocalDomain(spec) as domain:
            scheduler = subprocess.Popen(["unshare", "--pid", "--fork", sys.executable, "-c", SCHEDULER,
                                          domain.sockets[0]], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True)
            try:
                held = await asyncio.to_thread(scheduler.stdout.readline)
                domain.signal(0, signal.SIGSTOP)  # stuck: it answers nothing
                scheduler.stdin.write("stuck\n")
                scheduler.stdin.flush()
                tried = await asyncio.to_thread(scheduler.stdout.readline)
                domain.signal(0, signal.SIGKILL)  # its service manager's doing
                exit_code = await domain.wait_exit(0, 30)
                seen, errors = await asyncio.to_thread(scheduler.communicate, timeout=60)
            finally:
                if scheduler.poll() is None:
                    scheduler.kill()
            return scheduler.returncode, held + tried + seen, errors, exit_code

    returncode, out, errors, exit_code = asyncio.run(run())
    assert returncode == 0, errors
    assert "peer-pid 0 gone-before False" in out, out  # no pid to look up from there
    assert "stopped-here False" in out, out  # out of its sight: not its to signal
    assert "seen-gone True" in out, out
    assert exit_code == -signal.SIGKILL


def test_the_identity_names_the_daemon_that_answers_on_its_socket(run_dir):
    """A restarted daemon is another process: the pidfd taken before the
    restart says the old one is gone, a new one names the new process."""
    spec = DomainSpec(Topology(tp=1), run_dir)

    async def run():
        async with LocalDomain(spec) as domain:
            with Client(domain.sockets[0], timeout_s=10) as client:
                first = client.identify()
                assert not first.process.gone()
                domain.signal(0, signal.SIGKILL)
                await domain.wait_exit(0, 30)
                assert first.process.gone()
                await domain.restart(0)
                second = client.identify()
                assert not second.process.gone()
                first.close()
                second.close()

    asyncio.run(run())
