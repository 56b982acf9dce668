"""A round's edge: a rank whose round failed asks whether a peer completed it
(docs/design.md rule 4).

Gloo completes a collective on each rank apart, with no all-or-nothing end:
with three or more ranks, one rank can time out (a peer late at the very edge
of the timeout, or this rank frozen across it mid-collective) while the
others completed the round and apply it. What the timed-out collective left
in this rank's own buffer is never read: it may be partial, and gloo may
still write into it.

Each engine keeps its last completed round, number and reduced vector, in
memory only (nothing is written per round). A rank whose round failed marks
its record final (its engine decides nothing more) and raises its domain's
"wanted" flag for the epoch. Every daemon's heartbeat thread looks for the
flag at each beat; once it is up, it publishes the daemon's record, and again
whenever the record changes (a peer still in the round may yet complete it).
The failing rank reads its peers' records:

- a peer's record for the failed round holds the round's reduced vector,
  agreed (every rank's values, this rank's included, are in it): the rank
  delivers the round as completed, and its engine then breaks as for any
  failure (the epoch ends);
- once no live peer can have completed the round (the dead ones, by
  heartbeat, cannot tell), or `wait_s` has passed, the round fails as before.

Keys are namespaced by deployment, epoch and rank (the flag by domain).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from cpcache.agreement.bounded import bounded
from cpcache.agreement.collective import Rendezvous

log = logging.getLogger(__name__)

READ_S = 2.0  # the longest one read of the peers' records may take (the store may be away)


def record_key(rdzv: Rendezvous, rank: int) -> str:
    return f"{rdzv.namespace}/edge/rank{rank}"


def wanted_key(rdzv: Rendezvous, domain: tuple[int, ...]) -> str:
    return f"{rdzv.namespace}/edge/wanted/domain" + "-".join(map(str, domain))


@dataclass(frozen=True)
class Record:
    """A rank's last completed round: its number (0: none yet), whether it
    is final (the rank's engine completes no more rounds), its reduced
    vector; and, as published, the last round the rank had entered."""

    number: int
    final: bool
    vector: np.ndarray
    entered: int = 0

    def encode(self) -> bytes:
        head = b"%d %d %d " % (self.number, int(self.final), self.entered)
        return head + np.ascontiguousarray(self.vector, np.int64).tobytes()

    @staticmethod
    def decode(raw: bytes) -> Record:
        number, final, entered, body = raw.split(b" ", 3)
        return Record(int(number), final == b"1", np.frombuffer(body, dtype=np.int64).copy(), int(entered))


_NONE = Record(0, False, np.empty(0, dtype=np.int64))


class RoundWitness:
    """This rank's record, and the reading of its peers'. `completed` and
    `failed` are called from the agreement thread, `beat` from the heartbeat
    thread, `recover` from the agreement thread after a failed round."""

    def __init__(self, rdzv: Rendezvous, rank: int, domain: tuple[int, ...]) -> None:
        self._rdzv = rdzv
        self._rank = rank
        self._peers = tuple(r for r in domain if r != rank)
        self._record_key = record_key(rdzv, rank)
        self._wanted_key = wanted_key(rdzv, domain)
        self._record = _NONE  # replaced whole, never mutated: a reader sees one or the other
        self._published: Record | None = None
        self._published_entered = -1
        self._wanting = False  # this rank's round failed: raise the flag
        self._wanted = False  # the flag is up (raised here or seen): publish on change
        self._lock = threading.Lock()

    @property
    def record(self) -> Record:
        return self._record

    def completed(self, number: int, vector: np.ndarray) -> None:
        """Round `number` completed here with `vector` (not copied: never mutated)."""
        with self._lock:
            self._record = Record(number, self._record.final, vector)

    def ended(self) -> None:
        """The engine completes no more rounds."""
        with self._lock:
            self._record = replace(self._record, final=True)

    def failed(self) -> None:
        """A round failed here: the record is final, and the peers are asked for theirs."""
        with self._lock:
            self._record = replace(self._record, final=True)
            self._wanting = True

    def beat(self, store: Any, entered: int | Callable[[], int]) -> None:
        """At each heartbeat (`entered`: the last round this rank entered, or
        what reads it): raise the flag if this rank asks, look for it
        otherwise, and once it is up publish the record whenever it, or the
        round entered, changed. `entered` is read after the flag was seen up:
        a round entered after that read was entered after the asking rank's
        round failed, which gloo completes nowhere, so "had not entered" is
        never stale. One existence check per beat while nobody asks; store
        errors (RuntimeError) are the caller's."""
        if not self._wanted:
            if self._wanting:
                store.set(self._wanted_key, str(self._rank))
                self._wanted = True
            else:
                self._wanted = bool(store.check([self._wanted_key]))
        if not self._wanted:
            return
        record = self._record
        now_entered = entered() if callable(entered) else entered
        if record is not self._published or now_entered != self._published_entered:
            store.set(self._record_key, replace(record, entered=now_entered).encode())
            self._published, self._published_entered = record, now_entered

    def recover(self, store: Any, connect: Callable[[], Any], number: int, dead: dict[int, str],
                wait_s: float, poll_s: float, settle_s: float) -> tuple[int, np.ndarray] | None:
        """(rank, vector) of a peer that completed round `number`, or None
        once no live peer can have completed it, or `wait_s` has passed. A
        peer cannot have when its record is below the round and final, or
        published (which it is only once the flag is up: after a rank's round
        failed) before the peer entered the round: gloo closes a timed-out
        rank's connections, so a round entered after a rank failed it
        completes nowhere. `dead`: the heartbeat keys of the peers whose heartbeat
        stopped; one counts as dead only while its beat stays still, for
        `settle_s` at least (a loaded host's beat may just be late).
        `store`: a connection opened before (None: `connect` opens one)."""
        keys = {peer: record_key(self._rdzv, peer) for peer in self._peers}
        started = time.monotonic()
        deadline = started + wait_s

        def read() -> tuple[dict[int, Record], dict[int, bytes]]:
            nonlocal store
            if store is None:
                store = connect()
            found = {}
            for peer, key in keys.items():
                if store.check([key]):
                    found[peer] = Record.decode(store.get(key))
            return found, {peer: store.get(key) for peer, key in dead.items()}

        records: dict[int, Record] = {}
        beats: dict[int, bytes] = {}
        still: dict[int, bytes] = {}  # the beat each dead peer showed first
        while True:
            try:
                records, beats = bounded(read, READ_S, "reading the peers' last completed rounds")
            except RuntimeError as exc:
                store = None
                log.warning("round %d: the peers' last completed rounds could not be read (%s)", number, exc)
            for peer, record in sorted(records.items()):
                if record.number == number and len(record.vector):
                    log.warning("round %d failed here but rank %d completed it: its result is applied here too",
                                number, peer)
                    return peer, record.vector
            for peer, beat in beats.items():
                still.setdefault(peer, beat)
            silent = [p for p in dead if p in beats and beats[p] == still[p]]
            settled = time.monotonic() - started >= settle_s
            told = {p: r.number for p, r in records.items() if r.number < number and (r.final or r.entered < number)}
            if all(p in told or (settled and p in silent) for p in self._peers):
                log.warning("round %d: no live peer completed it (their last completed rounds: %s; dead: %s)",
                            number, told, [p for p in silent if p not in told])
                return None
            if time.monotonic() >= deadline:
                log.warning("round %d: no peer told within %.1fs whether it completed it (last completed rounds: "
                            "%s; dead: %s)", number, wait_s, {p: r.number for p, r in records.items()}, silent)
                return None
            time.sleep(poll_s)  # a poll of the store: peers publish at their next heartbeat
