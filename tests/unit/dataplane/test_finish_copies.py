"""A graceful stop finishes what a forward may read (docs/design.md rule 12): the
copies between device and host issued before a session ends or the movers
stop run to their end, bounded; storage work not started is cancelled; and
a load-back never queues behind write-throughs (a lane of its own)."""

import concurrent.futures
import os
import threading

import pytest
import torch

from cpcache.dataplane import movers
from cpcache.dataplane.movers import DEVICE, HOST, Finished, Tiers, Transfers
from cpcache.dataplane.pools import HostPool
from cpcache.dataplane.sessions import Session
from cpcache.load_signals import FAILED, LoadSignals
from tests.unit.dataplane.test_regions import MHA, Creator

pytestmark = pytest.mark.timeout(60)


def _boards(slots: int = 4) -> tuple[LoadSignals, LoadSignals]:
    """The scheduler's board and the daemon's mapping of it."""
    board = LoadSignals.create(slots)
    fd = os.dup(board.fd)
    return board, LoadSignals.mapped(fd, os.fstat(fd).st_size, slots)


class GatedWrites:
    """Write-throughs that wait at a gate: one running, the next queued (one thread)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started = threading.Event()
        self.gate = threading.Event()
        real = movers.MOVERS[(DEVICE, HOST)]

        def gated(tiers, job):
            self.started.set()
            assert self.gate.wait(30), "the gate was never opened"
            return real(tiers, job)

        monkeypatch.setitem(movers.MOVERS, (DEVICE, HOST), gated)


@pytest.fixture
def rig():
    creator = Creator(MHA)
    creator.fill_random(seed=11)
    device = creator.attach()
    board, device.signals = _boards()
    transfers = Transfers(Tiers(HostPool(MHA, pages=8, layout="page_first"), device), threads=1)
    # Host slot 4 holds device page 1, to load back.
    assert transfers.submit((DEVICE, HOST), [1], [4]).result().success
    yield creator, device, board, transfers
    transfers.close()


def test_a_load_does_not_queue_behind_a_write_through(rig, monkeypatch):
    creator, _, board, transfers = rig
    writes = GatedWrites(monkeypatch)
    write = transfers.submit((DEVICE, HOST), [2], [5])
    assert writes.started.wait(10)
    slot = board.claim(op=3)
    load = transfers.submit((HOST, DEVICE), [4], [6], signal=(slot, 3))
    assert load.result(10).success and board.progress(slot, 3) == MHA.layers
    assert not write.done()  # the write-through still holds its own lane
    writes.gate.set()
    assert write.result(10).success
    assert all(torch.equal(a, b) for a, b in zip(creator.page_bytes(6), creator.page_bytes(1)))


def test_copies_queued_when_their_session_ends_run_to_their_end(rig, monkeypatch):
    creator, device, board, transfers = rig
    session = Session(0, 1, device)
    writes = GatedWrites(monkeypatch)
    running = transfers.submit((DEVICE, HOST), [2], [5], session=session)
    assert writes.started.wait(10)
    queued = transfers.submit((DEVICE, HOST), [3], [6], session=session)  # behind it, on the one write thread
    session.end()
    late = transfers.submit((DEVICE, HOST), [3], [7], session=session)  # issued after the end: refused
    writes.gate.set()
    assert running.result(10).success and queued.result(10).success
    assert not late.result(10).success and session.refused == 1
    assert session.wait_device_quiet(10)


def test_finish_copies_waits_for_every_copy_issued_and_cancels_storage_work(rig, monkeypatch):
    creator, _, board, transfers = rig
    writes = GatedWrites(monkeypatch)
    write = transfers.submit((DEVICE, HOST), [2], [5])
    assert writes.started.wait(10)
    queued_write = transfers.submit((DEVICE, HOST), [3], [6])
    storage_gate = threading.Event()
    busy = transfers.run_storage_call(lambda: storage_gate.wait(30))
    not_started = transfers.run_storage_call(lambda: "never")
    slot = board.claim(op=9)
    load = transfers.submit((HOST, DEVICE), [4], [7], signal=(slot, 9))
    finishing = threading.Thread(target=lambda: finished.append(transfers.finish_copies(30)))
    finished: list[Finished] = []
    finishing.start()
    concurrent.futures.wait([not_started], 10)
    assert not_started.cancelled()  # no forward reads it
    writes.gate.set()
    finishing.join(30)
    # The two write-throughs were waited for; the load, on its own lane, may have ended before.
    assert len(finished) == 1 and finished[0].waited in (2, 3) and not finished[0].running \
        and not finished[0].cancelled, finished
    assert write.result().success and queued_write.result().success and load.result().success
    assert board.progress(slot, 9) == MHA.layers
    assert all(torch.equal(a, b) for a, b in zip(creator.page_bytes(7), creator.page_bytes(1)))
    # Stopped: a job submitted now is a failed transfer. Its load's board slot
    # is left as it is: the host pool lies in a memfd the scheduler maps, so
    # the scheduler finishes the load once this process has exited (FAILED
    # would stop its forward first; where the pool is not shared, FAILED).
    slot = board.claim(op=10)
    assert not transfers.submit((HOST, DEVICE), [4], [8], signal=(slot, 10)).result().success
    assert transfers.tiers.host.fd >= 0 and board.progress(slot, 10) == 0
    transfers.tiers.host.fd, shared = -1, transfers.tiers.host.fd
    slot = board.claim(op=11)
    assert not transfers.submit((HOST, DEVICE), [4], [8], signal=(slot, 11)).result().success
    assert board.progress(slot, 11) == FAILED
    transfers.tiers.host.fd = shared
    storage_gate.set()
    assert busy.result(10)


def test_finish_copies_is_bounded_and_gives_up_the_copies_not_started(rig, monkeypatch):
    _, _, board, transfers = rig
    writes = GatedWrites(monkeypatch)
    stuck = transfers.submit((DEVICE, HOST), [2], [5])  # a copy on a broken device
    assert writes.started.wait(10)
    behind = transfers.submit((DEVICE, HOST), [3], [6])
    slots = [4, 5, 6]
    assert transfers.in_flight.busy(slots)
    assert transfers.finish_copies(0.05) == Finished(waited=2, running=1, cancelled=1)
    assert behind.cancelled() and not stuck.done()
    writes.gate.set()
    assert stuck.result(10).success
    assert not transfers.in_flight.busy(slots)  # the cancelled copy's slot too
