"""The ring a daemon records its step outcomes in, read by its scheduler
after the daemon's death (cpcache/step_outcomes.py): a record of any size up
to half the log is found by epoch and step, never half-written, never
another step's, never bytes a later step wrote over it."""

import os

import pytest

from cpcache.step_outcomes import ENTRY_BYTES, HEADER_BYTES, OutcomeReader, OutcomeWriter

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def ring():
    writer = OutcomeWriter(slots=4, log_bytes=1024)
    reader = OutcomeReader(writer.read_only_fd())
    yield writer, reader
    reader.close()
    writer.close()


def test_a_recorded_step_is_found_by_its_epoch_and_step(ring):
    writer, reader = ring
    assert writer.record(3, 7, b"seven")
    assert reader.find(3, 7) == b"seven"
    assert reader.find(2, 7) is None and reader.find(3, 6) is None


def test_an_entry_used_again_forgets_the_step_before(ring):
    writer, reader = ring
    writer.record(1, 1, b"one")
    writer.record(1, 5, b"five")  # the same entry of four
    assert reader.find(1, 1) is None and reader.find(1, 5) == b"five"


def test_an_outcome_far_larger_than_an_entry_is_recorded_and_wraps_around_the_log(ring):
    writer, reader = ring
    outcomes = {step: bytes([step]) * 400 for step in range(1, 6)}  # 2,000 bytes through a 1,024-byte log
    for step, payload in outcomes.items():
        assert writer.record(1, step, payload)
    assert reader.find(1, 5) == outcomes[5] and reader.find(1, 4) == outcomes[4]  # step 5 wrapped around
    assert reader.find(1, 3) is None  # its bytes written over by steps 4 and 5 since: gone, not wrong


def test_an_outcome_larger_than_half_the_log_is_skipped_and_counted(ring):
    writer, reader = ring
    assert not writer.record(1, 2, b"x" * 513)
    assert reader.find(1, 2) is None and writer.skipped == 1


def test_the_default_ring_records_a_step_acking_tens_of_thousands_of_pages():
    writer = OutcomeWriter()
    reader = OutcomeReader(writer.read_only_fd())
    try:
        payload = os.urandom(36 * 30_000)  # about 36 bytes a page acked
        assert writer.record(1, 9, payload) and reader.find(1, 9) == payload
    finally:
        reader.close()
        writer.close()


def test_a_record_being_written_is_never_read(ring):
    """A writer stopped or killed in the middle leaves its entry's sequence odd."""
    writer, reader = ring
    writer.record(1, 3, b"three")
    at = HEADER_BYTES + 3 * ENTRY_BYTES
    os.pwrite(writer.fd, (5).to_bytes(8, "little"), at)  # an odd sequence: mid-write
    assert reader.find(1, 3) is None


def test_the_reader_can_not_write(ring):
    writer, reader = ring
    with pytest.raises(TypeError):
        reader._map[0] = 0


def test_anything_but_a_ring_is_refused():
    fd = os.memfd_create("not-a-ring")
    os.ftruncate(fd, 4096)
    with pytest.raises(ValueError):
        OutcomeReader(fd)
