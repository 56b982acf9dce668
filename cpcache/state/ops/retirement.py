"""Host slots given up by their owner, and the evictions that make room:
a retired slot goes back to the allocator once no rank has I/O on it
(docs/design.md rule 5)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cpcache.state.host_index import Entry
from cpcache.state.intents import Decisions, Intent
from cpcache.state.ledger import Asked, Ledger, LocalProgress, Operation
from cpcache.state.questions import RECLAIM


@dataclass
class Retirement(Operation):
    serial: int
    slots: list[int]

    def label(self) -> str:
        return f"retirement {self.serial}"

    def ask(self, ledger: Ledger, local: LocalProgress) -> Asked:
        return [(RECLAIM, int(local.idle(self.slots)))]

    def take_answers(self, ledger: Ledger, answers: dict[int, int], decisions: Decisions) -> list[Intent]:
        if answers.get(RECLAIM.code) == 1:
            ledger.close(self)
            ledger.allocator.reclaim(self.slots)
            ledger.record("reclaim", self.serial)
        return []


def retire(ledger: Ledger, slots: list[int]) -> None:
    if slots:
        ledger.allocator.retire(slots)
        retirement = Retirement(ledger.serial(), list(slots))
        ledger.add(retirement)
        ledger.record("retire", retirement.serial, tuple(slots))


def make_room(ledger: Ledger, count: int, keep: set[bytes] | frozenset[bytes] = frozenset()) -> bool:
    """Free host slots by evicting least recently used pages. Evicts
    nothing when that would not make enough room."""
    short = count - ledger.allocator.free_count
    if short <= 0:
        return True
    evicted = ledger.index.evict(short, _eviction_skip(ledger, keep), frees=_frees_slot, all_or_nothing=True)
    if not evicted:
        return False
    # An unreferenced page has no I/O on any rank: loads, backups and
    # writes hold their pages until every rank has finished with them.
    # The exception is a backup that timed out somewhere: its write may
    # still be reading, so those slots wait for an agreed reclaim.
    ledger.record("evict", tuple(p for p, _ in evicted))
    ledger.prefetched_evicted += sum(e.prefetched for _, e in evicted)
    ledger.host_evicted += len(evicted)
    ledger.allocator.free([e.slot for _, e in evicted if not e.io_suspect])
    retire(ledger, [e.slot for _, e in evicted if e.io_suspect])
    return True


def _eviction_skip(ledger: Ledger, keep: frozenset[bytes] | set[bytes]) -> Callable[[bytes, Entry], bool]:
    # Pages used in this step stay: the scheduler was told of them (a
    # Match, an accepted prefetch) and may load them in its next step.
    # Pages an ended prefetch holds for its request stay too.
    backed_only = ledger.write_policy.backup_before_evict

    def skip(page: bytes, entry: Entry) -> bool:
        return (entry.last_used >= ledger.step or entry.held > 0 or page in keep
                or (backed_only and not entry.backed_up))

    return skip


def _frees_slot(entry: Entry) -> bool:
    """An evicted page whose backup timed out somewhere leaves its slot
    retiring, not free: it does not count as room."""
    return not entry.io_suspect
