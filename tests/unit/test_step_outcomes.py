"""The ring a daemon records its step outcomes in, read by its scheduler
after the daemon's death (cpcache/step_outcomes.py): a record is found by
epoch and step, never half-written, never another step's."""

import os

import pytest

from cpcache.step_outcomes import HEADER_BYTES, OutcomeReader, OutcomeWriter

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def ring():
    writer = OutcomeWriter(slots=4, slot_bytes=256)
    reader = OutcomeReader(writer.read_only_fd())
    yield writer, reader
    reader.close()
    writer.close()


def test_a_recorded_step_is_found_by_its_epoch_and_step(ring):
    writer, reader = ring
    assert writer.record(3, 7, b"seven")
    assert reader.find(3, 7) == b"seven"
    assert reader.find(2, 7) is None and reader.find(3, 6) is None


def test_a_slot_used_again_forgets_the_step_before(ring):
    writer, reader = ring
    writer.record(1, 1, b"one")
    writer.record(1, 5, b"five")  # the same slot of four
    assert reader.find(1, 1) is None and reader.find(1, 5) == b"five"


def test_a_record_too_large_for_its_slot_is_skipped_and_counted(ring):
    writer, reader = ring
    assert not writer.record(1, 2, b"x" * 1000)
    assert reader.find(1, 2) is None and writer.skipped == 1


def test_a_record_being_written_is_never_read(ring):
    """A writer stopped or killed in the middle leaves its slot's sequence odd."""
    writer, reader = ring
    writer.record(1, 3, b"three")
    at = HEADER_BYTES + 3 * 256
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
