"""`cpcache launch` starts every rank, prints their sockets, and stops them
all cleanly on SIGINT."""

import asyncio
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import pytest

from cpcache.client import AsyncClient, Client

pytestmark = pytest.mark.timeout(90)

def test_launch_prints_sockets_and_stops_on_sigint(run_dir):
    proc = subprocess.Popen(
        [sys.executable, "-m", "cpcache.tools.cli", "launch", "--tp", "2", "--cp", "2", "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    sockets = []
    for line in proc.stdout:  # blocks on the launcher's own output, line by line
        if line.startswith("rank "):
            sockets.append(line.split("unix:", 1)[1].split()[0])
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


async def wait_serving(socket):
    async with AsyncClient(socket) as client:
        await client.wait_serving(30)


def daemon_pid(run_dir, rank):
    """The pid of the daemon of `rank` under `run_dir` (read from /proc)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        if b"cpcache.daemon" in argv and str(run_dir).encode() in b" ".join(argv) \
                and argv[argv.index(b"--rank") + 1] == str(rank).encode():
            return int(pid)
    raise AssertionError(f"no daemon of rank {rank} under {run_dir}")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_launch_starts_a_killed_rank_again_and_its_domain_forms_again(run_dir, sig):
    """A crash and an operator's `kill -TERM` of one daemon alike: a restart."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "cpcache.tools.cli", "launch", "--tp", "2", "--run-dir", str(run_dir),
         "--agreement-timeout", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    sockets = []
    for line in proc.stdout:
        if line.startswith("rank "):
            sockets.append(line.split("unix:", 1)[1].split()[0])
        if "press Ctrl-C" in line:
            break
    os.kill(daemon_pid(run_dir, 1), sig)
    exited = ""
    for line in proc.stdout:  # the launcher says what it did, line by line
        if "rank 1 exited" in line:
            exited = line
        if "rank 1 is back" in line:
            break
        assert "stopping the others" not in line, line
    # SIGTERM: a graceful stop, exit 0 (it was serving).
    assert f"exited with code {-sig if sig == signal.SIGKILL else 0}; starting it again" in exited, exited
    for socket in sockets:
        asyncio.run(wait_serving(socket))
        with Client(socket, timeout_s=10) as client:
            status = client.status()
            assert status.state == "serving" and status.epoch == 1
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, rest


KILLS_PER_RANK = 3  # each rank killed again and again: 12 deaths in a row


def status_of(socket):
    with Client(socket, timeout_s=10) as client:
        return client.status()


@pytest.mark.timeout(900)
def test_every_rank_killed_again_and_again_is_seen_and_its_domain_serves_again(run_dir, capsys):
    """4 ranks (tp 4, cp 2: one domain), each SIGKILLed KILLS_PER_RANK times
    in turn: the launcher sees every death (no thread waits for a child, so
    none runs out) and the domain serves again each time, in a later epoch."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "cpcache.tools.cli", "launch", "--tp", "4", "--cp", "2", "--run-dir", str(run_dir),
         "--agreement-timeout", "3"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    sockets = []
    for line in proc.stdout:
        if line.startswith("rank "):
            sockets.append(line.split("unix:", 1)[1].split()[0])
        if "press Ctrl-C" in line:
            break
    assert len(sockets) == 4
    pids = {rank: daemon_pid(run_dir, rank) for rank in range(4)}
    epoch, times = 0, []
    try:
        for _ in range(KILLS_PER_RANK):
            for rank in range(4):
                killed_at = time.monotonic()
                os.kill(pids[rank], signal.SIGKILL)
                seen = False
                for line in proc.stdout:
                    assert "stopping the others" not in line and "did not come back" not in line, line
                    seen = seen or f"rank {rank} exited with code -9" in line
                    if f"rank {rank} is back" in line:
                        pids[rank] = int(re.search(r"pid (\d+)", line).group(1))
                        break
                assert seen, f"the death of rank {rank} went unseen"
                for socket in sockets:
                    asyncio.run(wait_serving(socket))
                times.append(time.monotonic() - killed_at)
                statuses = [status_of(s) for s in sockets]
                epochs = {st.epoch for st in statuses}
                assert {st.state for st in statuses} == {"serving"} and len(epochs) == 1, statuses
                assert epochs.pop() > epoch
                epoch = statuses[0].epoch
    finally:
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, rest
    with capsys.disabled():
        print(f"\n{len(times)} kills, time from SIGKILL to the whole domain serving: "
              f"median {statistics.median(times):.2f}s, max {max(times):.2f}s, min {min(times):.2f}s")


def test_launch_config_sets_single_ranks_in_rank_tables_and_refuses_unknown_ones(tmp_path):
    from cpcache.tools.cli import _daemon_settings

    config = tmp_path / "daemons.toml"
    config.write_text('storage = "file"\nfault_copy_delay_ms = 10.0\n[rank.1]\nfault_copy_delay_ms = 400.0\n')
    every_rank, per_rank = _daemon_settings(str(config))
    assert every_rank == {"storage": "file", "fault_copy_delay_ms": 10.0}
    assert per_rank == {1: {"fault_copy_delay_ms": 400.0}}
    config.write_text('[rank.1]\nhost_pool_pages = 64\n')
    with pytest.raises(SystemExit, match=r"\[rank.1\] may set only fault_\* settings, not host_pool_pages"):
        _daemon_settings(str(config))
    config.write_text('[rank.one]\nfault_seed = 1\n')
    with pytest.raises(SystemExit, match="need a rank number"):
        _daemon_settings(str(config))


def test_ctrl_c_of_the_launchers_group_drains_every_daemon_once(run_dir):
    """A terminal's Ctrl-C signals the launcher's whole process group: each
    daemon is still told once (one drain, exit 0, its sockets removed),
    never twice (a second signal: exit 130 without draining)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "cpcache.tools.cli", "launch", "--tp", "2", "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    sockets = []
    for line in proc.stdout:
        if line.startswith("rank "):
            sockets.append(line.split("unix:", 1)[1].split()[0])
        if "press Ctrl-C" in line:
            break
    assert len(sockets) == 2
    for socket in sockets:
        asyncio.run(wait_serving(socket))
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal does
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, rest
    assert "exit codes [0, 0]" in rest, rest
    for rank in range(2):
        log = (run_dir / f"rank-{rank}.log").read_text()
        assert log.count("in-flight calls (was serving)") == 1, log
        assert "second signal" not in log and "exit code 0 (STOPPED)" in log, log
    assert not list(run_dir.glob("*.sock*"))


def wait_for_line(log, line, proc):
    """Until `log` holds `line`, reading it between waits on `proc` (whose
    exit ends the wait)."""
    while line not in log.read_text(errors="replace"):
        try:
            proc.wait(0.05)
        except subprocess.TimeoutExpired:
            continue
        raise AssertionError(f"the launcher exited before {log} said {line!r}")


def test_a_second_ctrl_c_makes_the_daemons_exit_now(run_dir, tmp_path):
    """A daemon draining a slow load-back (each layer 3 s late) at the first
    Ctrl-C; the second makes the launcher tell it again: it exits 130 without
    finishing, and so does the launcher."""
    import torch

    from cpcache.dataplane.pools import DevicePool
    from cpcache.geometry import KVGeometry
    from cpcache.keys import chain
    from cpcache.load_signals import LoadSignals

    config = tmp_path / "daemons.toml"
    config.write_text("host_pool_pages = 16\nio_threads = 1\nfault_copy_layer_delay_ms = 3000.0\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cpcache.tools.cli", "launch", "--tp", "1", "--run-dir", str(run_dir),
         "--config", str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        socket = None
        for line in proc.stdout:
            if line.startswith("rank "):
                socket = line.split("unix:", 1)[1].split()[0]
            if "press Ctrl-C" in line:
                break
        assert socket is not None
        asyncio.run(wait_serving(socket))  # a socket bound is not yet a daemon answering on it
        geometry = KVGeometry(layers=4, kv_kind="mha", heads=2, head_dim=16, dtype="float16", page_size=4)
        pool = DevicePool.create_sealed(geometry, 16)
        pool.tensor.view(torch.int16).random_()
        board = LoadSignals.create(4)
        from cpcache.client import SchedulerSession

        with Client(socket, timeout_s=30) as client:
            seed = client.attach("m", geometry, 16, pool_fd=pool.fd, load_signals=board).key_seed
            pages = [bytes.fromhex(h) for h in chain(list(range(8)), 4, seed)]
            session = SchedulerSession(client)
            written: list[bool] = []
            session.write_through(pages, [0, 1], done=written.append)
            while not written:
                session.flush()
            assert written == [True]
            assert session.load_opened(pages, [8, 9], board) is not None  # its copy issued: 12 s of layers
        os.killpg(proc.pid, signal.SIGINT)
        # Draining: finishing the load's layers (its server stops at once:
        # no step is in flight).
        wait_for_line(run_dir / "rank-0.log", "in-flight calls (was serving)", proc)
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, rest
    assert "exit codes [130]" in rest and "second signal" in rest, rest
    log = (run_dir / "rank-0.log").read_text()
    assert log.count("in-flight calls (was serving)") == 1 and "second signal: exiting without draining" in log, log
