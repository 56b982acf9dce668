"""Epochs: a domain that lost a rank forms again, under a new number.

The rendezvous store holds each agreement domain's current epoch (domains
of one deployment, e.g. attention-DP replicas, form and re-form apart). Ranks meet under
that epoch's namespace; once every rank of the domain has joined, the epoch
is marked formed. A rank that finds its epoch formed without it (it was
restarted) or broken (a peer was lost) moves the deployment to the next
epoch, and the others follow when they see the number move: the survivors
from their epoch watch, a stopped-and-continued rank from its first look.
Nobody decides anything in an epoch older than the store's, because a round
needs every rank of its epoch and they have all left it.

Moving the number is a compare-and-set from the epoch a rank leaves, so
ranks that leave the same epoch at once move it by one, not by one each.

Epoch numbers only grow, even across a restart of the store (which forgets
the counter and begins again from 0): a rank moves the counter to at least
the successor of the epoch it leaves, whatever the store reads, and a serving
rank that finds the store behind its own epoch writes that epoch back (with
its "formed" mark), so a restarted rank joining afterwards moves past it.
"""

from __future__ import annotations

import dataclasses
import time

from torch.distributed import TCPStore

from cpcache.agreement.collective import Rendezvous


class Epochs:
    def __init__(self, base: Rendezvous, domain: tuple[int, ...] = (0,)) -> None:
        self.base = base
        self._domain = "-".join(map(str, domain))
        self._key = f"cpcache/{base.deployment}/domain{self._domain}/current_epoch"

    def rendezvous(self, epoch: int) -> Rendezvous:
        return dataclasses.replace(self.base, epoch=epoch)

    def current(self, store: TCPStore) -> int:
        return int(store.add(self._key, 0))

    def to_join(self, store: TCPStore, configured: int) -> int:
        """The epoch a starting rank joins: the deployment's, or its
        successor when that one formed without this rank."""
        current = self.current(store)
        if current < configured:
            store.compare_set(self._key, str(current), str(configured))
            current = self.current(store)
        if self.formed(store, current):
            return self.advance(store, current)
        return current

    def advance(self, store: TCPStore, leaving: int) -> int:
        """Move the deployment past `leaving` (if nobody has yet) and return
        the epoch to join: always above `leaving`."""
        return self._raise_to(store, leaving + 1)

    def restore(self, store: TCPStore, serving: int) -> bool:
        """The store reads an epoch below the one this rank serves in (it
        restarted): write `serving` back, formed. True if it was behind."""
        if self.current(store) >= serving:
            return False
        self._raise_to(store, serving)
        self.mark_formed(store, serving)
        return True

    def _raise_to(self, store: TCPStore, at_least: int) -> int:
        # A compare-and-set from whatever the store reads, never from what this
        # rank assumes: after a store restart it reads 0, not the epoch left.
        while (current := self.current(store)) < at_least:
            store.compare_set(self._key, str(current), str(at_least))
        return current

    def formed_key(self, epoch: int) -> str:
        return f"{self.rendezvous(epoch).namespace}/formed/domain{self._domain}"

    def mark_formed(self, store: TCPStore, epoch: int) -> None:
        store.set(self.formed_key(epoch), "1")

    def formed(self, store: TCPStore, epoch: int) -> bool:
        return bool(store.check([self.formed_key(epoch)]))

    def gather(self, store: TCPStore, epoch: int, rank: int, ranks: tuple[int, ...], timeout_s: float,
               poll_s: float = 0.05) -> None:
        """Say this rank is in `epoch` and wait until every rank of the domain
        is, before any gloo group is joined (a join cannot be interrupted):
        `RuntimeError` once the deployment has moved past `epoch` (a peer
        gave it up: this rank follows at once, rather than waiting out a
        join no peer will make), or after `timeout_s`."""
        prefix = f"{self.rendezvous(epoch).namespace}/present/domain{self._domain}/"
        store.set(f"{prefix}{rank}", "1")
        keys = [f"{prefix}{r}" for r in ranks]
        deadline = time.monotonic() + timeout_s
        while not store.check(keys):
            if self.current(store) > epoch:
                raise RuntimeError(f"the deployment moved past epoch {epoch} while this rank waited for its peers")
            if time.monotonic() > deadline:
                missing = [r for r, key in zip(ranks, keys) if not store.check([key])]
                raise RuntimeError(f"ranks {missing} did not join epoch {epoch} within {timeout_s:.0f}s")
            time.sleep(poll_s)

    def exchange(self, store: TCPStore, epoch: int, rank: int, ranks: tuple[int, ...], offer: bytes,
                 timeout_s: float) -> list[bytes]:
        """Publish this rank's offer for `epoch` and read every rank's, in rank order."""
        import datetime

        prefix = f"{self.rendezvous(epoch).namespace}/offer/"
        store.set(f"{prefix}{rank}", offer)  # type: ignore[arg-type]  # bytes are stored as they are
        keys = [f"{prefix}{r}" for r in ranks]
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
        return [store.get(key) for key in keys]
