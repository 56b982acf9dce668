"""Write-through (device -> host) of a step's pages: the pages not yet
resident get slots of their own when it opens (two writes of one page both
copy it); once every rank's copy ended well they enter the host index,
and a failed copy anywhere frees the slots alike on every rank."""

from __future__ import annotations

from dataclasses import dataclass

from cpcache.requests import WriteRequest
from cpcache.state.intents import CopyToHost, Decisions, Intent
from cpcache.state.ledger import Asked, Ledger, LocalProgress, Operation
from cpcache.state.ops import backup
from cpcache.state.ops.retirement import make_room
from cpcache.state.questions import WRITE_OUTCOME, CopyOutcome


@dataclass
class Write(Operation):
    serial: int
    request: WriteRequest
    new: list[int]  # indexes into request.pages that were not resident when it opened
    slots: list[int]

    def label(self) -> str:
        return f"write {self.request.op_id}"

    def ask(self, ledger: Ledger, local: LocalProgress) -> Asked:
        return [(WRITE_OUTCOME, local.write_outcome(self.serial))]

    def take_answers(self, ledger: Ledger, answers: dict[int, int], decisions: Decisions) -> list[Intent]:
        outcome = answers.get(WRITE_OUTCOME.code, CopyOutcome.PENDING)
        if outcome == CopyOutcome.OK:
            _ack(ledger, self, decisions)
        elif outcome == CopyOutcome.FAILED:
            _fail(ledger, self, decisions)
        return []


def open_write(ledger: Ledger, req: WriteRequest, keep: set[bytes], decided: Decisions) -> list[Intent]:
    """Open a write; `keep`: pages no eviction may take to make its room."""
    resident = ledger.index.resident()
    new = [i for i, p in enumerate(req.pages) if p not in resident]
    if not make_room(ledger, len(new), keep):
        # A full pool is not a scheduler error: this write fails, alike on every rank.
        ledger.record("write refused", req.op_id)
        ledger.writes_refused += 1
        decided.write_failures.append(req.op_id)
        return []
    write = Write(ledger.serial(), req, new, ledger.allocator.allocate(len(new)))
    ledger.add(write, req.op_id)
    ledger.record("write", write.serial, req.op_id, req.pages, tuple(write.slots))
    return [CopyToHost(write.serial, tuple(req.device_pages[i] for i in new), tuple(write.slots))]


def _ack(ledger: Ledger, w: Write, decisions: Decisions) -> None:
    """Every rank's copy ended well: the pages enter the host index."""
    ledger.close(w, w.request.op_id)
    slot_of = dict(zip(w.new, w.slots))
    pages = w.request.pages
    index = ledger.index
    inserted: list[bytes] = []
    duplicate: list[int] = []
    resident = index.resident()
    run: list[int] = []  # indices of a run of consecutive pages entering together (one chain)
    entering: set[bytes] = set()  # the run's pages (a page twice in one write enters once)

    def insert_run() -> None:
        if run:
            parent = pages[run[0] - 1] if run[0] else w.request.parent
            index.insert([pages[i] for i in run], [slot_of[i] for i in run], parent, ledger.step)
            inserted.extend(pages[i] for i in run)
            run.clear()
            entering.clear()

    for i, page in enumerate(pages):
        slot = slot_of.get(i)
        if slot is None or page in resident or page in entering:
            insert_run()
            if slot is not None:
                duplicate.append(slot)  # another operation brought it meanwhile
            continue  # (else: it was resident when the write opened)
        run.append(i)
        entering.add(page)
    insert_run()
    ledger.allocator.free(duplicate)  # every rank's copy into it has ended
    index.touch([p for p in pages if p in resident], ledger.step)
    ledger.record("ack", w.serial, tuple(duplicate))
    decisions.write_acks.append(w.request.op_id)
    if ledger.write_policy.backup_after_ack:
        backup.queue(ledger, inserted)


def _fail(ledger: Ledger, w: Write, decisions: Decisions) -> None:
    """Some rank's copy failed; every rank's has ended: the slots are free."""
    ledger.close(w, w.request.op_id)
    ledger.allocator.free(w.slots)
    ledger.record("write failed", w.serial)
    decisions.write_failures.append(w.request.op_id)
