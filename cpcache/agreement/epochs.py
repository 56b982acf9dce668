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
"""

from __future__ import annotations

import dataclasses

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
        the epoch to join."""
        if self.current(store) <= leaving:
            store.compare_set(self._key, str(leaving), str(leaving + 1))
        return self.current(store)

    def mark_formed(self, store: TCPStore, epoch: int) -> None:
        store.set(f"{self.rendezvous(epoch).namespace}/formed/domain{self._domain}", "1")

    def formed(self, store: TCPStore, epoch: int) -> bool:
        return bool(store.check([f"{self.rendezvous(epoch).namespace}/formed/domain{self._domain}"]))

    def exchange(self, store: TCPStore, epoch: int, rank: int, ranks: tuple[int, ...], offer: bytes,
                 timeout_s: float) -> list[bytes]:
        """Publish this rank's offer for `epoch` and read every rank's, in rank order."""
        import datetime

        prefix = f"{self.rendezvous(epoch).namespace}/offer/"
        store.set(f"{prefix}{rank}", offer)  # type: ignore[arg-type]  # bytes are stored as they are
        keys = [f"{prefix}{r}" for r in ranks]
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
        return [store.get(key) for key in keys]
