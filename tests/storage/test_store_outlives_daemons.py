"""The store outlives its daemons (docs/operations.md, "Mooncake Store"): the
memory of a Mooncake Store is lent by a segment owner that `cpcache launch`
keeps (a Mooncake client of its own that unmounts its segment when it stops), and the daemons mount
none. A daemon SIGKILLed and restarted leaves every page it or its peer put
in the store, every rank finds them after attaching again, and the writes
after the re-attach are stored (none targets the dead daemon). Real
processes: a mooncake_master, the segment owner, two cpcached."""

import uuid

import pytest

from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.topology import Topology
from tests.multirank.attacks.common import PAGE_HASHES, PAGES, Scheduler, attach_all, close_all, make, step_all

pytestmark = pytest.mark.timeout(180)


async def _stored(schedulers, step, requests_step):
    """Step until the write-throughs of `requests_step` are acknowledged and
    every backup they started has ended: -> (the last step, the backups' outcomes)."""
    acked, backups = False, {}
    while not acked or not backups:
        step += 1
        replies = await step_all(schedulers, step)
        assert len({r.wire for r in replies}) == 1
        acked = acked or requests_step in replies[0].write_acks
        backups.update(replies[0].backups)
    return step, backups


async def test_pages_in_the_store_outlive_a_killed_daemon_and_are_found_by_every_rank(run_dir, mooncake_master):
    from cpcache.client import CacheRequests, WriteRequest

    spec = DomainSpec(Topology(tp=2), run_dir, agreement_timeout_s=2.0, extra=dict(
        host_pool_pages=32, storage="mooncake", storage_master=mooncake_master.master,
        storage_metadata_server=mooncake_master.metadata_server, storage_local_hostname="127.0.0.1",
        storage_segment_bytes=16 << 20, storage_timeout_s=5.0, rendezvous_timeout_s=20.0))
    model = f"outlives-{uuid.uuid4().hex[:8]}"  # keys of its own in the session's store
    first, later = PAGE_HASHES[:PAGES // 2], PAGE_HASHES[PAGES // 2:]
    async with LocalDomain(spec) as domain:
        owner = domain.segment_owner
        assert owner is not None and spec.config(0, 0, "x").storage_segment_bytes == 0  # the daemons lend nothing
        schedulers = make(domain, run_dir, 1)
        try:
            await attach_all(schedulers, model)
            write = WriteRequest(1, first, list(range(len(first))))
            await step_all(schedulers, 1, CacheRequests(writes=(write,)))
            step, backups = await _stored(schedulers, 1, 1)
            assert all(backups.values()), backups
            for s in schedulers:
                assert (await s.client.match(first)).storage_pages == len(first)
        finally:
            await close_all(schedulers)

        domain.signal(1, 9)
        assert await domain.wait_exit(1, 30) == -9
        await domain.restart(1)

        schedulers = [Scheduler(socket) for socket in domain.sockets]
        try:
            replies = await attach_all(schedulers, model)
            step = replies[0].last_step
            for s in schedulers:  # every rank finds what was stored before the death
                assert (await s.client.match(first)).storage_pages == len(first)
            write = WriteRequest(2, later, list(range(len(later))))
            step += 1
            await step_all(schedulers, step, CacheRequests(writes=(write,)))
            step, backups = await _stored(schedulers, step, 2)
            assert all(backups.values()), backups  # stored in the owner's segment, not the dead daemon's
            for s in schedulers:
                assert (await s.client.match(later)).storage_pages == len(later)
        finally:
            await close_all(schedulers)
    assert owner.proc is not None and owner.proc.poll() is not None  # stopped with the domain, after its daemons


def test_the_segment_owner_runs_as_a_service_of_its_own(tmp_path, mooncake_master):
    """`cpcache segment-owner`: ready once it holds its share, stopped by SIGTERM with exit 0."""
    import signal
    import subprocess
    import sys

    config = tmp_path / "daemons.toml"
    config.write_text(f'storage = "mooncake"\nstorage_master = "{mooncake_master.master}"\n'
                      f'storage_metadata_server = "{mooncake_master.metadata_server}"\n'
                      'storage_local_hostname = "127.0.0.1"\n')
    proc = subprocess.Popen([sys.executable, "-m", "cpcache.tools.cli", "segment-owner", "--config", str(config),
                             "--bytes", str(16 << 20), "--log", str(tmp_path / "owner.log")],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert "cpcache: holding 16777216 bytes" in proc.stdout.readline()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
    log = (tmp_path / "owner.log").read_text()
    assert "segment owner: mounted 16777216 bytes" in log and "segment owner: unmounted" in log
