"""A daemon's step outcomes, recorded where its own scheduler can read them
after the daemon's death (docs/design.md rule 12).

A daemon that dies between a step's round and its reply leaves its
scheduler asking the peers' daemons how the step ended; if those are
stopped or dead too, nobody can tell, and guessing would split the ranks.
So each daemon writes every step's outcome (its `OutcomeReply`, serialized)
into shared memory as soon as the round is applied, before it answers: a
memfd it hands to its scheduler over the `.pools` socket. Writing is a
memory copy, no system call, so the window left between the round and the
record is the copy itself.

The memory is a ring of fixed slots, step `s` in slot `s % slots`. Each slot
is guarded by a sequence number (a seqlock): odd while it is written, so a
reader never takes a half-written record, whether the writer is stopped in
the middle or died there; a CRC-32 of the payload guards against a reader
that sees the stores out of order (CPython issues no memory barriers, and
weakly ordered CPUs reorder). An outcome too large for a slot is not
recorded (its scheduler asks the peers, as before).
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct
import zlib

MAGIC = b"CPCOUT02"
_HEADER = struct.Struct("<8sIIQ")  # magic, slots, slot bytes, the writing process's instance
_SLOT = struct.Struct("<QQQII")  # sequence, epoch, step, payload length, payload CRC-32
HEADER_BYTES = 64
SLOTS = 128
SLOT_BYTES = 32 * 1024
PAYLOAD_BYTES = SLOT_BYTES - _SLOT.size


def size(slots: int = SLOTS, slot_bytes: int = SLOT_BYTES) -> int:
    return HEADER_BYTES + slots * slot_bytes


class OutcomeWriter:
    """The daemon's side: a memfd of the ring, written from the event loop only."""

    def __init__(self, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES) -> None:
        self.fd = os.memfd_create("cpcache-step-outcomes", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, size(slots, slot_bytes))
        self._map = mmap.mmap(self.fd, size(slots, slot_bytes))
        self.instance = secrets.randbits(63) or 1
        _HEADER.pack_into(self._map, 0, MAGIC, slots, slot_bytes, self.instance)
        self._slots, self._slot_bytes = slots, slot_bytes
        self.skipped = 0  # outcomes too large for a slot

    def record(self, epoch: int, step: int, payload: bytes) -> bool:
        """Record step `step`'s outcome. -> False when it does not fit a slot."""
        if len(payload) > self._slot_bytes - _SLOT.size:
            self.skipped += 1
            return False
        at = HEADER_BYTES + (step % self._slots) * self._slot_bytes
        sequence = _SLOT.unpack_from(self._map, at)[0]
        _SLOT.pack_into(self._map, at, sequence + 1, 0, 0, 0, 0)  # odd: being written
        self._map[at + _SLOT.size:at + _SLOT.size + len(payload)] = payload
        _SLOT.pack_into(self._map, at, sequence + 2, epoch, step, len(payload), zlib.crc32(payload))
        return True

    def read_only_fd(self) -> int:
        """A new read-only descriptor of the ring, for a scheduler."""
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        self._map.close()
        os.close(self.fd)


class OutcomeReader:
    """The scheduler's side: the ring of its daemon, read-only (takes `fd`)."""

    def __init__(self, fd: int) -> None:
        try:
            self._map = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, self._slots, self._slot_bytes, self.instance = _HEADER.unpack_from(self._map, 0)
        if magic != MAGIC or len(self._map) < size(self._slots, self._slot_bytes):
            self._map.close()
            raise ValueError("not a cpcache step-outcome ring")

    def find(self, epoch: int, step: int) -> bytes | None:
        """Step `step` of epoch `epoch`'s recorded outcome, or None (not
        recorded, overwritten since, or being written)."""
        at = HEADER_BYTES + (step % self._slots) * self._slot_bytes
        before, got_epoch, got_step, length, crc = _SLOT.unpack_from(self._map, at)
        if before % 2 or (got_epoch, got_step) != (epoch, step) or length > self._slot_bytes - _SLOT.size:
            return None
        payload = bytes(self._map[at + _SLOT.size:at + _SLOT.size + length])
        if _SLOT.unpack_from(self._map, at)[0] != before or zlib.crc32(payload) != crc:
            return None
        return payload

    def close(self) -> None:
        self._map.close()
