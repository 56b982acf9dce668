"""The load-signal board both sides share: slots claimed by the scheduler,
progress published by the daemon, waits that end on a layer, a failure or
a deadline, and a slot given back only to be claimed by another load. The
board fails closed: a slot claimed again reads FAILED to its old load, and
no store of an old load counts as progress of the new one."""

import os
import threading
import time

import pytest

from cpcache.dataplane.signal_board import open_board
from cpcache.errors import InvalidArgument
from cpcache.load_signals import FAILED, MAX_LAYERS, LoadSignals

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


def test_a_slot_claimed_again_reads_failed_to_its_old_load_not_landed():
    board = LoadSignals.create(1)
    daemon = _daemon_side(board)
    slot = board.claim(op=1)
    daemon.publish(slot, 1, 2)
    assert board.claim(op=2) == 0  # none free
    board.release(slot)
    again = board.claim(op=2)
    assert again == slot and board.progress(slot, 2) == 0
    daemon.publish(slot, 2, 5)  # the new load lands whole
    # A forward still waiting on the old load must not take that for its own.
    assert board.progress(slot, 1) == FAILED and not board.owns(slot, 1)
    assert not board.wait(slot, 1, 1, time.monotonic() + 1)
    assert board.wait(slot, 2, 5, time.monotonic() + 1)


def test_a_publish_of_an_old_load_never_satisfies_the_new_one():
    board = LoadSignals.create(1)
    daemon = _daemon_side(board)
    slot = board.claim(op=1)
    as_the_old_load_saw_it = _board_bytes(board)
    board.release(slot)
    assert board.claim(op=2) == slot
    daemon.publish(slot, 1, 5)  # after the claim: not stored at all
    daemon.fail(slot, 1)
    assert board.progress(slot, 2) == 0
    # A publish whose claim check ran just before the slot was claimed again
    # (check, then store: not atomic), its store landing after the claim.
    _store_late(board, as_the_old_load_saw_it, slot, 1, 5)
    assert board.progress(slot, 2) == 0  # not the new load's: nothing copied yet, and not failed
    with pytest.raises(TimeoutError, match="0 of 1 layers"):
        board.wait(slot, 2, 1, time.monotonic() + 0.01)
    daemon.publish(slot, 2, 1)  # the new load's own next publish counts again
    assert board.wait(slot, 2, 1, time.monotonic() + 1)


def _board_bytes(board: LoadSignals) -> bytes:
    return os.pread(board.fd, os.fstat(board.fd).st_size, 0)


def _store_late(board: LoadSignals, seen: bytes, slot: int, op: int, layers: int) -> None:
    """What `publish(slot, op, layers)` stores when it checks the board as
    `seen`, written into `board` as it is now: the publish runs on a copy,
    and the words it changed there are copied over (whatever the format)."""
    copy = LoadSignals.create(board.slots)
    os.pwrite(copy.fd, seen, 0)
    _daemon_side(copy).publish(slot, op, layers)
    stored = _board_bytes(copy)
    for offset in range(0, len(seen), 8):
        if stored[offset : offset + 8] != seen[offset : offset + 8]:
            os.pwrite(board.fd, stored[offset : offset + 8], offset)


def test_progress_up_to_max_layers_and_failed_stay_clear_of_a_large_ops_tag():
    board = LoadSignals.create(1)
    daemon = _daemon_side(board)
    big = (1 << 50) + 3  # beyond the 40 bits of a tag
    slot = board.claim(op=big)
    daemon.publish(slot, big, MAX_LAYERS)
    assert board.progress(slot, big) == MAX_LAYERS
    daemon.fail(slot, big)
    assert board.progress(slot, big) == FAILED


def test_the_daemon_refuses_a_board_too_small_or_a_slot_outside_it():
    board = LoadSignals.create(4)
    fd = os.dup(board.fd)
    with pytest.raises(InvalidArgument, match="needs"):
        LoadSignals.mapped(fd, 16, 4096)
    daemon = _daemon_side(board)
    with pytest.raises(InvalidArgument, match="outside"):
        daemon.check_slot(5)


def test_the_daemon_refuses_a_model_with_more_layers_than_a_progress_word_counts():
    board = LoadSignals.create(1)
    with pytest.raises(InvalidArgument, match=f"up to {MAX_LAYERS} layers"):
        open_board(os.dup(board.fd), 1, MAX_LAYERS + 1)
    assert open_board(os.dup(board.fd), 1, 80).slots == 1
