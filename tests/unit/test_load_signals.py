"""The load-signal board both sides share: slots claimed by the scheduler,
progress published by the daemon, waits that end on a layer, a failure or
a deadline, and a slot given back only to be claimed by another load."""

import os
import threading
import time

import pytest

from cpcache.errors import InvalidArgument
from cpcache.load_signals import DECIDED, FAILED, LoadSignals

pytestmark = pytest.mark.timeout(30)


def _daemon_side(board: LoadSignals) -> LoadSignals:
    """The board as the daemon maps it, from a descriptor of its own."""
    fd = os.dup(board.fd)
    return LoadSignals.mapped(fd, os.fstat(fd).st_size, board.slots)


def test_progress_published_by_the_daemon_is_what_the_scheduler_reads():
    board = LoadSignals.create(2)
    daemon = _daemon_side(board)
    slot = board.claim(op=41)
    assert slot and board.progress(slot, 41) == 0
    daemon.publish(slot, 41, 3)
    assert board.progress(slot, 41) == 3
    assert board.wait(slot, 41, 3, time.monotonic() + 1)
    daemon.fail(slot, 41)
    assert board.progress(slot, 41) == FAILED and not board.wait(slot, 41, 1, time.monotonic() + 1)


def test_a_wait_ends_when_its_layer_lands_or_at_its_deadline():
    board = LoadSignals.create(1)
    daemon = _daemon_side(board)
    slot = board.claim(op=7)
    landed = threading.Event()
    threading.Timer(0.05, lambda: (daemon.publish(slot, 7, 2), landed.set())).start()
    assert board.wait(slot, 7, 2, time.monotonic() + 10)
    assert landed.is_set()
    with pytest.raises(TimeoutError, match="2 of 3 layers"):
        board.wait(slot, 7, 3, time.monotonic() + 0.05)


def test_a_slot_given_back_is_claimed_again_and_its_old_load_reads_as_decided():
    board = LoadSignals.create(1)
    daemon = _daemon_side(board)
    slot = board.claim(op=1)
    assert board.claim(op=2) == 0  # none free
    board.release(slot)
    again = board.claim(op=2)
    assert again == slot and board.progress(slot, 2) == 0
    assert board.progress(slot, 1) == DECIDED  # given back only once decided: nothing to wait for
    daemon.publish(slot, 1, 5)  # a late write for the old load touches nothing
    assert board.progress(slot, 2) == 0


def test_the_daemon_refuses_a_board_too_small_or_a_slot_outside_it():
    board = LoadSignals.create(4)
    fd = os.dup(board.fd)
    with pytest.raises(InvalidArgument, match="needs"):
        LoadSignals.mapped(fd, 16, 4096)
    daemon = _daemon_side(board)
    with pytest.raises(InvalidArgument, match="outside"):
        daemon.check_slot(5)
