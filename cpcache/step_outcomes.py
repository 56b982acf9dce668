"""A daemon's step outcomes, recorded where its own scheduler can read them
after the daemon's death (docs/design.md rule 12).

A daemon that dies between a step's round and its reply leaves its
scheduler asking the peers' daemons how the step ended; if those are
stopped or dead too, nobody can tell, and guessing would split the ranks.
So each daemon writes every step's outcome (its `OutcomeReply`, serialized)
into shared memory as soon as the round is applied, before it answers: a
memfd it hands to its scheduler over the `.pools` socket. Writing is a
memory copy, no system call; what is left between a round completing on
the peers and its record here is this daemon's application of the round
and that copy.

The memory is an index of fixed entries, step `s` at entry `s % slots`,
and a log the payloads are appended to, around and around: an outcome of
any size up to half the log is recorded (a step acking a large write lists
every page), and the last steps' outcomes stay readable until the log has
gone around past them. Each entry is guarded by a sequence number (a
seqlock): odd while it is written, so a reader never takes a half-written
record, whether the writer is stopped in the middle or died there. The
header says how far the log has been claimed; a reader that finds the log
claimed past its record's bytes since (overwritten by later steps) takes
nothing, and a CRC-32 of the payload guards against a reader that sees the
stores out of order (CPython issues no memory barriers, and weakly ordered
CPUs reorder). An outcome larger than half the log is not recorded (its
scheduler asks the peers) and is counted.
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct
import zlib

MAGIC = b"CPCOUT03"
_HEADER = struct.Struct("<8sIIQQ")  # magic, slots, log bytes, the writer's instance, log bytes claimed so far
_CLAIMED_AT = 24  # the claimed count's place in the header
_ENTRY = struct.Struct("<QQQQII")  # sequence, epoch, step, where in the log (not wrapped), length, CRC-32
HEADER_BYTES = 64
ENTRY_BYTES = 64
SLOTS = 128
LOG_BYTES = 16 * 1024 * 1024  # a few hundred thousand pages acked in one step fit


def size(slots: int = SLOTS, log_bytes: int = LOG_BYTES) -> int:
    return HEADER_BYTES + slots * ENTRY_BYTES + log_bytes


class OutcomeWriter:
    """The daemon's side: a memfd of the ring, written from the event loop only."""

    def __init__(self, slots: int = SLOTS, log_bytes: int = LOG_BYTES) -> None:
        self.fd = os.memfd_create("cpcache-step-outcomes", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, size(slots, log_bytes))
        self._map = mmap.mmap(self.fd, size(slots, log_bytes))
        self.instance = secrets.randbits(63) or 1
        _HEADER.pack_into(self._map, 0, MAGIC, slots, log_bytes, self.instance, 0)
        self._slots, self._log_bytes = slots, log_bytes
        self._log_at = HEADER_BYTES + slots * ENTRY_BYTES
        self._claimed = 0
        self.skipped = 0  # outcomes larger than half the log

    def record(self, epoch: int, step: int, payload: bytes) -> bool:
        """Record step `step`'s outcome. -> False when it is larger than half the log."""
        length = len(payload)
        if length > self._log_bytes // 2:
            self.skipped += 1
            return False
        at = HEADER_BYTES + (step % self._slots) * ENTRY_BYTES
        sequence = _ENTRY.unpack_from(self._map, at)[0]
        _ENTRY.pack_into(self._map, at, sequence + 1, 0, 0, 0, 0, 0)  # odd: being written
        start = self._claimed
        self._claimed += length
        # Claimed before written: a reader of an older record there sees it gone.
        struct.pack_into("<Q", self._map, _CLAIMED_AT, self._claimed)
        _write_around(self._map, self._log_at, self._log_bytes, start, payload)
        _ENTRY.pack_into(self._map, at, sequence + 2, epoch, step, start, length, zlib.crc32(payload))
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
        magic, self._slots, self._log_bytes, self.instance, _ = _HEADER.unpack_from(self._map, 0)
        if magic != MAGIC or len(self._map) < size(self._slots, self._log_bytes):
            self._map.close()
            raise ValueError("not a cpcache step-outcome ring")
        self._log_at = HEADER_BYTES + self._slots * ENTRY_BYTES

    def find(self, epoch: int, step: int) -> bytes | None:
        """Step `step` of epoch `epoch`'s recorded outcome, or None (not
        recorded, overwritten since, or being written)."""
        at = HEADER_BYTES + (step % self._slots) * ENTRY_BYTES
        before, got_epoch, got_step, start, length, crc = _ENTRY.unpack_from(self._map, at)
        if before % 2 or (got_epoch, got_step) != (epoch, step) or length > self._log_bytes // 2:
            return None
        payload = _read_around(self._map, self._log_at, self._log_bytes, start, length)
        claimed = struct.unpack_from("<Q", self._map, _CLAIMED_AT)[0]
        if (_ENTRY.unpack_from(self._map, at)[0] != before or claimed - start > self._log_bytes
                or zlib.crc32(payload) != crc):
            return None
        return payload

    def close(self) -> None:
        self._map.close()


def _write_around(memory: mmap.mmap, base: int, log_bytes: int, start: int, payload: bytes) -> None:
    first = start % log_bytes
    head = min(len(payload), log_bytes - first)
    memory[base + first:base + first + head] = payload[:head]
    memory[base:base + len(payload) - head] = payload[head:]


def _read_around(memory: mmap.mmap, base: int, log_bytes: int, start: int, length: int) -> bytes:
    first = start % log_bytes
    head = min(length, log_bytes - first)
    return bytes(memory[base + first:base + first + head]) + bytes(memory[base:base + length - head])
