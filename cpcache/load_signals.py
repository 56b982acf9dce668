"""How far each load-back has come, layer by layer, shared by a scheduler
and its rank's daemon: what lets the forward start while pages are still
being loaded (the overlapped load-back).

Which pages are loaded into which slots is agreed, as every decision is,
before the forward that reads them starts. What is local is how far this
rank's own copy has come, and only this rank's forward reads it: layer l
waits for layer l of its own loads, nothing else.

A board is a small sealed memfd that the scheduler creates and hands over
with its pool: `slots` slots of two int64 words. The scheduler claims a slot
for a load (writing the load's op id and 0 before the Step that carries the
load is sent); the daemon's mover writes the layers copied so far after each
layer, or FAILED. A slot is claimed again only once the load is decided (its
copies ended on every rank). On CUDA hosts the progress says that a layer's
copy was queued, and that layer's event (one per slot and layer, shared by
IPC handle) completes when the copy has run: the forward's stream waits on
the event, the host only for the queueing.

Stores are word-sized and in program order (the mover's copy, then the
progress word), which x86-64's memory order keeps for the reader.
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
FAILED = -1
DECIDED = 1 << 62  # the progress of a load whose slot was given back
_SLOT_BYTES = 16  # op id, progress
_SPIN = 200  # polls before the wait starts sleeping between them
_NAP_S = 50e-6


class LoadSignals:
    """One board, from either side: the scheduler claims slots and waits on
    them; the daemon publishes into them."""

    def __init__(self, mapping: mmap.mmap, slots: int, fd: int = -1) -> None:
        self._mapping = mapping
        self.slots = slots
        self.fd = fd  # the creator's descriptor, to hand over
        self.events: list[list] | None = None  # the daemon's, on CUDA hosts: per slot, per layer
        self._words = np.frombuffer(mapping, dtype=np.int64, count=slots * 2).reshape(slots, 2)
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
        self._words[slot - 1, 1] = 0
        self._words[slot - 1, 0] = op
        return slot

    def release(self, slot: int) -> None:
        """The load of `slot` is decided: its copies ended on every rank."""
        self._free.append(slot)

    def in_use(self) -> int:
        return self.slots - len(self._free)

    def progress(self, slot: int, op: int) -> int:
        """Layers of load `op` copied (CUDA: queued) so far, or FAILED;
        DECIDED once its slot went to another load (a slot is given back
        only when its load is decided: every rank's copy ended)."""
        owner, progress = self._words[slot - 1]
        return int(progress) if owner == op else DECIDED

    def wait(self, slot: int, op: int, layers: int, deadline: float) -> bool:
        """Until `layers` layers of load `op` are copied (True), its copy
        failed (False), or `deadline` (time.monotonic) passes (TimeoutError)."""
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
        """`layers` layers of load `op` are copied (CUDA: queued)."""
        if self._words[slot - 1, 0] == op:  # a slot the scheduler gave another load meanwhile is not touched
            self._words[slot - 1, 1] = layers

    def fail(self, slot: int, op: int) -> None:
        self.publish(slot, op, FAILED)


def _size(slots: int) -> int:
    return max(mmap.PAGESIZE, -(-slots * _SLOT_BYTES // mmap.PAGESIZE) * mmap.PAGESIZE)
