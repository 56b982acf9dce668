"""Backup (host -> storage) of resident pages, per the write policy: after a
write-through's ack, when a page turns hot, or under write_back when free
slots run low. The pages stay referenced until every rank's write has
ended; the agreed outcome marks them backed up, or not."""

from __future__ import annotations

from dataclasses import dataclass

from cpcache.state.intents import Decisions, Intent, Store
from cpcache.state.ledger import Asked, Ledger, LocalProgress, Operation
from cpcache.state.questions import BACKUP_OUTCOME, BackupOutcome


@dataclass
class Backup(Operation):
    serial: int
    pages: list[bytes]
    # Queued to make room under write_back (not for pages the scheduler just
    # wrote or loaded): queued again after each failure while storage is
    # down, so a scheduler does not step for it (`CacheState.daemon_open`).
    for_room: bool = False

    def label(self) -> str:
        return f"backup {self.serial}"

    def ask(self, ledger: Ledger, local: LocalProgress) -> Asked:
        return [(BACKUP_OUTCOME, local.backup_outcome(self.serial))]

    def take_answers(self, ledger: Ledger, answers: dict[int, int], decisions: Decisions) -> list[Intent]:
        outcome = answers.get(BACKUP_OUTCOME.code, BackupOutcome.PENDING)
        if outcome != BackupOutcome.PENDING:
            _end(ledger, self, BackupOutcome(outcome), decisions)
        return []


def queue(ledger: Ledger, pages: list[bytes], for_room: bool = False) -> None:
    """Back up `pages`: opened now, started at the end of the round being
    applied (`start_queued`)."""
    if pages:
        ledger.index.ref(pages, +1)
        backup = Backup(ledger.serial(), pages, for_room)
        ledger.add(backup)
        slots = tuple(ledger.index[p].slot for p in pages)  # held by the reference until it ends
        ledger.stores.append(Store(backup.serial, tuple(pages), slots, ledger.sharding))
        ledger.record("backup", backup.serial, tuple(pages))


def relieve_pressure(ledger: Ledger) -> None:
    """Under write_back only backed-up pages may be evicted: when free
    slots run low, back up the least recently used pages that are not."""
    if not ledger.write_policy.backup_before_evict:
        return
    low_water = max(1, ledger.allocator.pages // 8)
    short = low_water - ledger.allocator.free_count
    if short <= 0:
        return
    # A page queued for a backup already holds a reference: not taken twice.
    queue(ledger, ledger.index.least_recent_unbacked(short), for_room=True)


def start_queued(ledger: Ledger) -> list[Intent]:
    """The writes of the backups queued since the last call."""
    stores: list[Intent] = list(ledger.stores)
    ledger.stores.clear()
    return stores


def _end(ledger: Ledger, backup: Backup, outcome: BackupOutcome, decisions: Decisions) -> None:
    ledger.close(backup)
    stored, suspect = outcome == BackupOutcome.STORED, outcome == BackupOutcome.TIMED_OUT
    index = ledger.index
    for page in backup.pages:
        entry = index[page]
        entry.refs -= 1
        if entry.backed_up and not stored:
            index.mark_backed_up(page, False)
        entry.backed_up = stored
        entry.io_suspect = entry.io_suspect or suspect
    ledger.record("backed up", backup.serial, int(outcome))
    decisions.backups.append((backup.serial, outcome == BackupOutcome.STORED))
    decisions.backup_pages.append(tuple(backup.pages))
