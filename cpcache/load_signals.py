"""How far each load-back has come, layer by layer, shared by a scheduler
and its rank's daemon: what lets the forward start while pages are still
being loaded (the overlapped load-back).

Which pages are loaded into which slots is agreed, as every decision is,
before the forward that reads them starts. What is local is how far this
rank's own copy has come, and only this rank's forward reads it: layer l
waits for layer l of its own loads, nothing else.

A board is a small sealed memfd that the scheduler creates and hands over
with its pool: `slots` slots of two int64 words,

    word 0, progress: tag << 23 | layers copied (all ones: FAILED), written
            by the daemon's mover after each layer (reset by the claim);
    word 1, claim:    the op id of the load that owns the slot, written by
            the scheduler only.

The tag is the low 40 bits of the op id (op ids count up from 1 in each
scheduler session, and each session has a board of its own), so the word
says whose progress it is. The scheduler claims a slot for a load (progress
reset to the load's tag and 0, then its op id, before the Step that carries
the load is sent); a slot is claimed again only once its load is decided
(its copies ended on every rank). On CUDA hosts the progress says that a
layer's copy was queued, and that layer's event (one per slot and layer,
shared by IPC handle) completes when the copy has run: the forward's stream
waits on the event, the host only for the queueing.

The board fails closed. A reader waiting on load X counts only a progress
word that carries X's tag, and only while the claim word is still X:

- claim word not X: the slot went to another load, so X is not what the
  slot holds: FAILED. (SGLang's forward runs on the scheduler's thread and
  the backend forgets decided loads before the next batch is built, so a
  forward never waits on a load whose slot was given back; if it ever did,
  it stops rather than take another load's progress for its own.)
- claim word X, progress word of another tag: a store of an older load that
  landed after X's claim (the daemon checks the claim word, then stores, not
  atomically: numpy has no compare-and-swap). It counts as nothing copied,
  and the wait goes on until X's own next publish overwrites it or the
  deadline passes. Not FAILED: a stale store is no sign that X failed, and
  FAILED stops the server; not progress either: an old load's publish never
  satisfies a new one. Within one daemon such a store cannot happen at all
  (X's slot is claimed only after the old load's job, publish included,
  ended on this rank), and a daemon of an ended session writes to the
  board of that session, which a new attach replaced.

Progress first, claim second: the reverse of the untagged board of earlier
versions (op id, progress), so that a scheduler and a daemon of different
versions never take each other's words for progress (the daemon finds no
claim of its op and publishes nothing; the forward waits until its deadline
and stops: closed, not open).

Stores are aligned 8-byte words in program order (the mover's copy, then
the progress word), which x86-64's memory order keeps for the reader.
"""

from __future__ import annotations

import collections
import fcntl
import mmap
import os
import time

import numpy as np

from cpcache.errors import InvalidArgument

SLOTS = 64  # loads in flight at once per rank; a load finding none free is waited whole
FAILED = -1  # what `progress` reads for a load whose copy failed, or whose slot is no longer its own
_SLOT_BYTES = 16  # progress word (tag << _PROGRESS_BITS | layers), claim word (op id)
_PROGRESS_BITS = 23
_TAG_BITS = 40  # tag << _PROGRESS_BITS stays below 2**63: a word is never negative
_FAILED_FIELD = (1 << _PROGRESS_BITS) - 1  # the progress field of a failed copy
MAX_LAYERS = _FAILED_FIELD - 1  # the most layers a load can publish
_SPIN = 200  # polls before the wait starts sleeping between them
_NAP_S = 50e-6


def _tag(op: int) -> int:
    return op & ((1 << _TAG_BITS) - 1)


def _progress_word(op: int, layers: int) -> int:
    """Load `op`'s progress, `layers` copied or FAILED, as one word."""
    field = _FAILED_FIELD if layers == FAILED else layers
    return _tag(op) << _PROGRESS_BITS | field


class LoadSignals:
    """One board, from either side: the scheduler claims slots and waits on
    them; the daemon publishes into them."""

    def __init__(self, mapping: mmap.mmap, slots: int, fd: int = -1) -> None:
        self._mapping = mapping
        self.slots = slots
        self.fd = fd  # the creator's descriptor, to hand over
        self.events: list[list] | None = None  # the daemon's, on CUDA hosts: per slot, per layer
        words = np.frombuffer(mapping, dtype=np.int64, count=slots * 2).reshape(slots, 2)
        self._progress, self._claims = words[:, 0], words[:, 1]
        # Oldest given back first: a slot is claimed again as late as can be.
        self._free = collections.deque(range(1, slots + 1)) if fd >= 0 else collections.deque()
        self.identity: tuple = ()  # the daemon's: which board this is (a new one is a new attach)

    @staticmethod
    def create(slots: int = SLOTS, name: str = "cpcache-load-signals") -> LoadSignals:
        """The scheduler's side: a fresh board in a sealed memfd."""
        if slots < 1:
            raise InvalidArgument(f"a load-signal board needs at least 1 slot, not {slots}")
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        size = _size(slots)
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        return LoadSignals(mmap.mmap(fd, size), slots, fd)

    @staticmethod
    def mapped(fd: int, size: int, slots: int) -> LoadSignals:
        """The daemon's side: map a board handed over (already checked to be
        a sealed shmem memfd of `size` bytes). Takes the descriptor."""
        try:
            if not 1 <= slots <= 1 << 16:
                raise InvalidArgument(f"attach: load_signals.slots must be between 1 and 65536, not {slots}")
            if size < _size(slots):
                raise InvalidArgument(f"attach: a board of {slots} load-signal slots needs {_size(slots)} bytes, "
                                      f"but its memfd holds {size}")
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return LoadSignals(mapping, slots)

    def close_fd(self) -> None:
        """After the handover: the daemon holds its own descriptor."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # -- the scheduler's side --------------------------------------------------------

    def claim(self, op: int) -> int:
        """A free slot for load `op` (1-based), reset to no layer copied; 0 when none is free."""
        if not self._free:
            return 0
        slot = self._free.popleft()
        self._progress[slot - 1] = _progress_word(op, 0)
        self._claims[slot - 1] = op
        return slot

    def release(self, slot: int) -> None:
        """The load of `slot` is decided: its copies ended on every rank."""
        self._free.append(slot)

    def in_use(self) -> int:
        return self.slots - len(self._free)

    def owns(self, slot: int, op: int) -> bool:
        """Whether `slot` is still claimed by load `op`."""
        return int(self._claims[slot - 1]) == op

    def progress(self, slot: int, op: int) -> int:
        """Layers of load `op` copied (CUDA: queued) so far, or FAILED: its
        copy failed, or its slot went to another load (fails closed: no
        other load's progress is ever taken for its own). A progress word of
        another load in a slot still claimed by `op` (a stale store) counts
        as nothing copied."""
        if not self.owns(slot, op):
            return FAILED
        word = int(self._progress[slot - 1])
        if word >> _PROGRESS_BITS != _tag(op):
            return 0
        field = word & _FAILED_FIELD
        return FAILED if field == _FAILED_FIELD else field

    def wait(self, slot: int, op: int, layers: int, deadline: float) -> bool:
        """Until `layers` layers of load `op` are copied (True), its copy
        failed or its slot went to another load (False), or `deadline`
        (time.monotonic) passes (TimeoutError)."""
        polls = 0
        while True:
            progress = self.progress(slot, op)
            if progress == FAILED:
                return False
            if progress >= layers:
                return True
            polls += 1
            if polls > _SPIN:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"load {op}: {progress} of {layers} layers copied when its time ran out")
                time.sleep(_NAP_S)

    # -- the daemon's side ---------------------------------------------------------------

    def check_slot(self, slot: int) -> None:
        if not 1 <= slot <= self.slots:
            raise InvalidArgument(f"load signal slot {slot} is outside the attached board of {self.slots} slots")

    def publish(self, slot: int, op: int, layers: int) -> None:
        """`layers` layers of load `op` are copied (CUDA: queued): one store
        of a word tagged with `op`. A slot the scheduler gave another load
        is not touched; a store racing with that claim carries `op`'s tag,
        which the new load does not count (see the module's docstring)."""
        if self._claims[slot - 1] == op:
            self._progress[slot - 1] = _progress_word(op, layers)

    def fail(self, slot: int, op: int) -> None:
        self.publish(slot, op, FAILED)


def _size(slots: int) -> int:
    return max(mmap.PAGESIZE, -(-slots * _SLOT_BYTES // mmap.PAGESIZE) * mmap.PAGESIZE)
