"""Load-back (host -> device) of resident pages: opened only with every
page resident, the pages referenced until every rank's copy has ended; the
agreed outcome is loaded or failed."""

from __future__ import annotations

from dataclasses import dataclass

from cpcache.requests import LoadRequest
from cpcache.state.intents import CopyToDevice, Decisions, Intent
from cpcache.state.ledger import Asked, Ledger, LocalProgress, Operation
from cpcache.state.ops import backup
from cpcache.state.questions import LOAD_OUTCOME, CopyOutcome


@dataclass
class Load(Operation):
    serial: int
    request: LoadRequest
    slots: list[int]

    def label(self) -> str:
        return f"load {self.request.op_id}"

    def ask(self, ledger: Ledger, local: LocalProgress) -> Asked:
        return [(LOAD_OUTCOME, local.load_outcome(self.serial))]

    def take_answers(self, ledger: Ledger, answers: dict[int, int], decisions: Decisions) -> list[Intent]:
        outcome = answers.get(LOAD_OUTCOME.code, CopyOutcome.PENDING)
        if outcome != CopyOutcome.PENDING:
            _end(ledger, self, CopyOutcome(outcome), decisions)
        return []


def open_load(ledger: Ledger, req: LoadRequest) -> list[Intent]:
    """Open a load whose pages were all found resident."""
    pages = list(req.pages)
    entries = [ledger.index[p] for p in pages]
    load = Load(ledger.serial(), req, [e.slot for e in entries])
    ledger.index.ref(pages, +1)
    ledger.index.touch(pages, ledger.step, hit=True)
    for entry in entries:
        entry.prefetched = False
    ledger.add(load, req.op_id)
    ledger.hit_pages["host"] += len(pages)
    ledger.record("load", load.serial, req.op_id, req.pages)
    if ledger.write_policy.backup_when_hot:
        backup.queue(ledger, [p for p, e in zip(pages, entries) if e.hits == 2 and not e.backed_up])
    return [CopyToDevice(load.serial, req.op_id, tuple(load.slots), req.device_pages, req.signal_slot)]


def _end(ledger: Ledger, load: Load, outcome: CopyOutcome, decisions: Decisions) -> None:
    ledger.close(load, load.request.op_id)
    ledger.index.ref(list(load.request.pages), -1)
    ledger.record("loaded", load.serial, int(outcome))
    if outcome == CopyOutcome.OK:
        decisions.loads.append((load.request.op_id, len(load.slots)))
    else:
        decisions.load_failures.append(load.request.op_id)
