"""A load-back copied layer by layer for a forward that reads it as it
lands: every layer published on the board once its copies are done, the
pages bit-exact in every host layout and per-layer region, and a copy that
fails at a layer (injected) publishes FAILED with the layers before it
copied and the ones after it untouched; run by run and by gather / scatter."""

import os

import pytest
import torch

from cpcache.dataplane.copy_faults import CopyFaults
from cpcache.dataplane.movers import DEVICE, HOST, Tiers, Transfers
from cpcache.dataplane.pools import HostPool
from cpcache.host_layout import LAYOUTS
from cpcache.load_signals import FAILED, LoadSignals
from tests.unit.dataplane.test_regions import MHA, Creator

pytestmark = pytest.mark.timeout(60)


def _boards(slots: int = 2) -> tuple[LoadSignals, LoadSignals]:
    """The scheduler's board and the daemon's mapping of it."""
    board = LoadSignals.create(slots)
    fd = os.dup(board.fd)
    return board, LoadSignals.mapped(fd, os.fstat(fd).st_size, slots)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layer_is_published_once_it_landed_bit_exact(layout, copy_path):
    creator = Creator(MHA)
    creator.fill_random(seed=3)
    device = creator.attach()
    board, device.signals = _boards()
    host = HostPool(MHA, pages=8, layout=layout)
    transfers = Transfers(Tiers(host, device), threads=2)
    try:
        assert transfers.submit((DEVICE, HOST), [1, 2], [4, 5]).result().success
        originals = {p: creator.page_bytes(p) for p in (1, 2)}
        slot = board.claim(op=77)
        assert transfers.submit((HOST, DEVICE), [4, 5], [6, 7], signal=(slot, 77)).result().success
        assert board.progress(slot, 77) == MHA.layers
        for p, t in ((1, 6), (2, 7)):
            assert all(torch.equal(a, b) for a, b in zip(creator.page_bytes(t), originals[p]))
    finally:
        transfers.close()


def test_a_copy_failing_at_a_layer_publishes_failed_and_copies_only_the_layers_before_it(copy_path):
    creator = Creator(MHA)
    creator.fill_random(seed=5)
    device = creator.attach()
    board, device.signals = _boards()
    host = HostPool(MHA, pages=8, layout="page_first")
    transfers = Transfers(Tiers(host, device), threads=2, copy_faults=CopyFaults(load_fail_layer=1))
    try:
        assert transfers.submit((DEVICE, HOST), [1], [4]).result().success  # write-throughs are not touched
        original = creator.page_bytes(1)
        s = MHA.page_size
        for layer in creator.buffers:
            for b in layer:
                b[6 * s:7 * s].zero_()
        slot = board.claim(op=5)
        result = transfers.submit((HOST, DEVICE), [4], [6], signal=(slot, 5)).result()
        assert not result.success and board.progress(slot, 5) == FAILED
        assert transfers.counters()["failed_jobs"][(HOST, DEVICE)] == 1
        got = creator.page_bytes(6)  # per layer, per buffer
        per_layer = len(got) // MHA.layers
        assert all(torch.equal(a, b) for a, b in zip(got[:per_layer], original[:per_layer]))  # layer 0 landed
        assert all(not a.any() for a in got[per_layer:])  # layers 1 and 2 untouched
    finally:
        transfers.close()


def test_a_load_of_an_ended_session_is_refused_and_published_failed():
    from cpcache.dataplane.sessions import Session

    creator = Creator(MHA)
    device = creator.attach()
    board, device.signals = _boards()
    host = HostPool(MHA, pages=8, layout="page_first")
    transfers = Transfers(Tiers(host, device), threads=1)
    session = Session(0, 1, device)
    session.end()
    try:
        slot = board.claim(op=8)
        assert not transfers.submit((HOST, DEVICE), [0], [0], session=session, signal=(slot, 8)).result().success
        assert board.progress(slot, 8) == FAILED
    finally:
        transfers.close()
