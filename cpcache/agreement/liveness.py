"""Heartbeats in the rendezvous store, and naming the ranks a failed round
lost.

Gloo says that a round failed, not which peer is to blame. Each daemon
publishes ``"<beat> <last round entered>"`` every `interval_s`; after a failed
round the survivors watch their peers' beats for a short window. A rank whose
beat does not move is stopped or dead; a rank that never entered the failed
round is stuck before it (its scheduler never sent that step).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from cpcache.agreement.bounded import bounded
from cpcache.agreement.collective import Rendezvous
from cpcache.agreement.witness import RoundWitness


def heartbeat_key(rdzv: Rendezvous, rank: int) -> str:
    return f"{rdzv.namespace}/heartbeat/{rank}"


class Heartbeat:
    """Publishes this rank's beat from a daemon thread until stopped."""

    def __init__(self, rdzv: Rendezvous, rank: int, interval_s: float = 0.1,
                 witness: RoundWitness | None = None) -> None:
        """`witness`: this rank's record of its last completed round, looked
        after at each beat (published once a peer whose round failed asks)."""
        self._rdzv = rdzv
        self.witness = witness
        self._rank = rank
        self._interval_s = interval_s
        self._round = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{rank}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def entered(self, round_number: int) -> None:
        self._round = round_number

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        beat = 0
        store = None
        while not self._stop.is_set():
            try:
                store = store or self._rdzv.connect(timeout_s=max(1.0, 5 * self._interval_s))
                store.set(heartbeat_key(self._rdzv, self._rank), f"{beat} {self._round}")
                if self.witness is not None:
                    self.witness.beat(store, lambda: self._round)  # read after the flag is seen
            except RuntimeError:
                store = None  # the store is gone or slow; peers will see a stale beat
            beat += 1
            self._stop.wait(self._interval_s)


@dataclass(frozen=True)
class Diagnosis:
    missing: tuple[int, ...]
    reason: str
    stalled: tuple[int, ...] = ()  # of `missing`, those whose heartbeat stopped (dead or stopped)


CONNECT_S = 2.0


def diagnose(
    rdzv: Rendezvous, peers: tuple[int, ...], failed_round: int, window_s: float, store: Any = None
) -> Diagnosis:
    """Watch `peers`' heartbeats for `window_s` and name those that are
    stopped, dead, or never reached `failed_round`. `store`: a connection
    opened before the failure (a loaded host, just when a peer dies, may take
    longer than CONNECT_S to accept a new one); a new one is opened only if
    it fails. Bounded by the window plus three times max(CONNECT_S, window)
    even when the store is unreachable or stopped (`bounded`)."""
    keys = [heartbeat_key(rdzv, r) for r in peers]
    limit = max(CONNECT_S, window_s)

    def fresh() -> list[bytes]:
        nonlocal store
        store = rdzv.connect(timeout_s=limit)
        return store.multi_get(keys)

    try:
        try:
            if store is None:
                raise RuntimeError("no connection opened before")
            opened = store
            first = bounded(lambda: opened.multi_get(keys), limit, "reading the heartbeats")
        except RuntimeError:
            first = bounded(fresh, limit, "connecting to read the heartbeats")
        time.sleep(window_s)  # the observation window itself, not a wait for an event
        current = store
        second = bounded(lambda: current.multi_get(keys), limit, "reading the heartbeats")
    except RuntimeError as exc:
        return Diagnosis((), f"the rendezvous store at {rdzv.host}:{rdzv.port} is unreachable ({exc})")
    stalled, behind = [], []
    for rank, before, after in zip(peers, first, second):
        beat_before, _ = before.decode().split()
        beat_after, round_after = after.decode().split()
        if beat_before == beat_after:
            stalled.append(rank)
        elif int(round_after) < failed_round:
            behind.append(rank)
    reasons = []
    if stalled:
        reasons.append(f"ranks {stalled} stopped sending heartbeats (dead or stopped)")
    if behind:
        reasons.append(f"ranks {behind} never entered round {failed_round} (their scheduler did not send that step)")
    return Diagnosis(tuple(sorted(stalled + behind)), "; ".join(reasons) or "no peer is missing by heartbeat",
                     tuple(stalled))
