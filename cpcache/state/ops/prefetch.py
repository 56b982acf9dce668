"""Prefetch (storage -> host): opened with a lookup of how many of its pages
are in storage; the agreed hit (MIN) is fetched into slots of its own, or
the prefetch is revoked (below the threshold, host pool full). Each poll of
the scheduler asks whether it may end (the policy's vote) and with how many
pages (MIN); it ends accepted with those pages, or is revoked by the
scheduler. Slots it gave up go back once no rank reads into them. A
prefetch that asks to hold its pages keeps them from eviction once it
ended, until the scheduler releases them (`prefetch_holds`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cpcache.requests import PrefetchRequest
from cpcache.state.intents import Decisions, Fetch, Intent, Lookup
from cpcache.state.ledger import Asked, Ledger, LocalProgress, Operation
from cpcache.state.ops import prefetch_holds
from cpcache.state.ops.retirement import make_room, retire
from cpcache.state.questions import NOT_YET, PREFETCH_DONE, PREFETCH_HIT, PREFETCH_MAY_END

ENDED_PREFETCHES_KEPT = 4096


@dataclass
class Prefetch(Operation):
    serial: int
    request: PrefetchRequest
    hit: int = NOT_YET  # agreed storage hit; NOT_YET while being asked
    slots: list[int] = field(default_factory=list)
    polled_at: int = 0  # the step of the scheduler's latest poll (0: none pending)

    def label(self) -> str:
        return f"prefetch {self.request.op_id}"

    def ask(self, ledger: Ledger, local: LocalProgress) -> Asked:
        if self.hit == NOT_YET:
            return [(PREFETCH_HIT, local.exists(self.serial))]
        if not self.polled_at:
            return []
        done = local.fetched(self.serial)
        complete = done >= self.hit or local.fetch_ended(self.serial)
        may_end = ledger.prefetch_policy.may_end(complete, local.elapsed_s(self.serial), self.request.tokens)
        return [(PREFETCH_DONE, done), (PREFETCH_MAY_END, int(may_end))]

    def take_answers(self, ledger: Ledger, answers: dict[int, int], decisions: Decisions) -> list[Intent]:
        hit = answers.get(PREFETCH_HIT.code, NOT_YET)
        if hit != NOT_YET and self.hit == NOT_YET:
            return _decide_hit(ledger, self, hit, decisions)
        if answers.get(PREFETCH_MAY_END.code) == 1:
            _accept(ledger, self, answers[PREFETCH_DONE.code], decisions)
        elif PREFETCH_MAY_END.code in answers and ledger.round > self.polled_at:
            self.polled_at = 0  # not yet, and asked after the latest poll: the scheduler polls again
        return []


def find(ledger: Ledger, op_id: int) -> Prefetch | None:
    return ledger.find(op_id, Prefetch)


def open_prefetch(ledger: Ledger, req: PrefetchRequest) -> list[Intent]:
    prefetch = Prefetch(ledger.serial(), req)
    ledger.add(prefetch, req.op_id)
    ledger.record("prefetch", prefetch.serial, req.op_id, req.pages)
    ledger.prefetch_asked += len(req.pages)
    return [Lookup(prefetch.serial, tuple(req.pages), ledger.sharding)]


def poll(ledger: Ledger, op_id: int, step: int) -> None:
    """The scheduler asks whether prefetch `op_id` may end (ignored if it ended)."""
    if (pf := find(ledger, op_id)) is not None:
        pf.polled_at = step
        ledger.record("poll", pf.serial)


def revoke(ledger: Ledger, pf: Prefetch, why: str, decisions: Decisions, reason: str = "revoked") -> None:
    """`reason`: what the pages of its hit are lost to (ledger.LOST_REASONS);
    before its hit is agreed, every page it asked for."""
    _close(ledger, pf)
    ledger.lost[reason] += len(pf.request.pages) if pf.hit == NOT_YET else pf.hit
    ledger.record("revoke", pf.serial)
    retire(ledger, pf.slots)  # back to the allocator once no rank reads into them
    decisions.prefetch_revoked.append((pf.request.op_id, why))


def _decide_hit(ledger: Ledger, pf: Prefetch, hit: int, decisions: Decisions) -> list[Intent]:
    pf.hit = hit
    ledger.record("hit", pf.serial, hit)
    decisions.prefetch_hits.append((pf.request.op_id, hit))
    ledger.lost["storage_miss"] += len(pf.request.pages) - hit
    if hit * ledger.page_size < ledger.config.prefetch_threshold_tokens:
        revoke(ledger, pf, f"storage hit of {hit * ledger.page_size} tokens is below the threshold", decisions,
               "below_threshold")
        return []
    if not make_room(ledger, hit):
        revoke(ledger, pf, f"host pool full: {hit} pages do not fit", decisions, "host_full")
        return []
    pf.slots = ledger.allocator.allocate(hit)
    ledger.record("fetch", pf.serial, tuple(pf.slots))
    return [Fetch(pf.serial, tuple(pf.request.pages[:hit]), tuple(pf.slots), ledger.sharding)]


def _accept(ledger: Ledger, pf: Prefetch, done: int, decisions: Decisions) -> None:
    """The first `done` pages are in every rank's slots: each enters, but a
    page another operation brought meanwhile keeps that copy (its fetched
    slot is given up), and the pages after it still enter, under it."""
    _close(ledger, pf)
    index = ledger.index
    brought: list[tuple[bytes, int]] = []
    given_up: list[int] = []
    # The pages entering under one parent: the request's, or a page kept.
    run_parent: bytes | None = pf.request.parent
    run_pages: list[bytes] = []
    run_slots: list[int] = []
    for page, slot in zip(pf.request.pages[:done], pf.slots):
        if page in index:  # already resident: keep that copy
            index.insert(run_pages, run_slots, run_parent, ledger.step)
            run_parent, run_pages, run_slots = page, [], []
            given_up.append(slot)
        else:
            run_pages.append(page)
            run_slots.append(slot)
            brought.append((page, slot))
    index.insert(run_pages, run_slots, run_parent, ledger.step)
    for page, _ in brought:
        entry = index[page]
        entry.backed_up = True  # it came from storage
        entry.prefetched = True
    ledger.record("accept", pf.serial, len(brought))
    ledger.prefetch_resident += len(given_up)
    if done < pf.hit:  # the rest of its hit is read into retiring slots, and thrown away
        ledger.ended_short(pf.serial, pf.hit - done)
    if pf.request.hold:  # every page that entered or was kept is resident
        prefetch_holds.hold(ledger, pf.request.op_id, list(pf.request.pages[: min(done, len(pf.slots))]))
    retire(ledger, given_up + list(pf.slots[done:]))  # once their reads end
    decisions.prefetch_done.append((pf.request.op_id, done))
    ledger.hit_pages["storage"] += len(brought)


def _close(ledger: Ledger, pf: Prefetch) -> None:
    ledger.close(pf, pf.request.op_id)
    ended = ledger.ended_prefetches
    ended[pf.request.op_id] = None
    while len(ended) > ENDED_PREFETCHES_KEPT:
        ended.popitem(last=False)
