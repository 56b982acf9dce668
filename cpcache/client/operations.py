"""A scheduler session's operations, apart from how its steps are sent.

Each cache operation is collected for the next step, stays open at the
daemon once a step carried it, and is closed by the agreed reply that
decides it (its `done` callback called); every reply also moves the mirror
of the host pool, the tally and the decision log. Every rank makes the same
calls in the same order and follows the same agreed replies, so every rank
holds the same operations at the same iteration. `session.SchedulerSession`
sends the steps over a client, one per scheduler iteration.

Each operation names its tiers: `write_through` copies device pages into
the host pool (device -> host; the daemon backs them up to storage by its
`write_policy`), `load` copies host pages into device pages (host ->
device), `prefetch` brings storage pages into the host pool (storage ->
host).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from cpcache.client.messages import StepResult
from cpcache.client.outcomes import DecisionLog, HostMirror, Tally
from cpcache.load_signals import LoadSignals
from cpcache.requests import CacheRequests, LoadRequest, PrefetchRequest, WriteRequest

Stored = Callable[[bool], None]  # a write's end: did its pages enter the host pool?
Landed = Callable[[bool], None]  # a load's end: are its pages on every rank's device?
Brought = Callable[[int], None]  # a prefetch's end: pages it brought to the host pool (0: revoked)


@dataclass
class _Unsent:
    """The operations collected since the last step, in `CacheRequests` field order."""

    prefetches: list[PrefetchRequest] = field(default_factory=list)
    prefetch_polls: list[int] = field(default_factory=list)
    revokes: list[int] = field(default_factory=list)
    writes: list[WriteRequest] = field(default_factory=list)
    loads: list[LoadRequest] = field(default_factory=list)
    hold_releases: list[int] = field(default_factory=list)

    def requests(self) -> CacheRequests:
        return CacheRequests(tuple(self.prefetches), tuple(self.prefetch_polls), tuple(self.revokes),
                             tuple(self.writes), tuple(self.loads), tuple(self.hold_releases))

    def any(self) -> bool:
        return bool(self.prefetches or self.prefetch_polls or self.revokes or self.writes or self.loads
                    or self.hold_releases)


# The replies a poll's answer may come in, counted from its own step's: at
# agreement lag 0 (the SGLang backend refuses any other) a round asks its
# questions before its step's operations open, so the next round answers.
POLL_REPLIES = 2


@dataclass
class _Prefetch:
    rid: str | None
    done: Brought | None
    hold: bool = False
    polled: bool = False  # a step carried a poll of it


class SessionOperations:
    """A session's operations: the ones collected for the next step, the
    ones open at the daemon, and what the agreed replies decided of them.
    It sends nothing: its caller takes each step (`next_step`) and hands
    the reply back (`follow`, or `not_taken`)."""

    def __init__(self, first_step: int = 1, *, decisions: DecisionLog | None = None,
                 epoch: int | None = None) -> None:
        """`decisions`: where the agreed decisions are logged, if kept.
        `epoch`: the one the session was attached in (`AttachReply.epoch`),
        which its steps name: a step of an ended epoch opens nothing."""
        self.epoch = epoch
        self.tally = Tally()
        self.host = HostMirror()
        self.decisions = decisions
        self._step = first_step - 1
        self._ids = itertools.count(1)
        self._unsent = _Unsent()
        self._prefetches: dict[int, _Prefetch] = {}  # open prefetch op -> its request and end
        self._prefetch_of: dict[str, int] = {}  # request id -> its open prefetch op
        self._brought: dict[str, int] = {}  # request id -> pages its ended prefetch brought (0: revoked)
        self._held: dict[str, int] = {}  # request id -> its ended prefetch whose pages the daemon holds
        self._writes: dict[int, tuple[int, Stored | None]] = {}  # open write op -> (pages, its end)
        self._loads: dict[int, tuple[int, Landed | None]] = {}  # open load op -> (pages, its end)
        self._signal_slots: dict[int, tuple[LoadSignals, int]] = {}  # open load op -> where its layers are published
        self._hits_unknown: set[int] = set()  # prefetches a step carried, their storage hit not yet agreed
        self._polls_answered_by = 0  # the last step whose reply may answer a poll sent
        self._daemon_open = 0  # the daemon's own open backups, as the last reply agreed
        # Called with every agreed reply, once the session followed it (the
        # SGLang backend's KV events of the host pool and storage).
        self.listeners: list[Callable[[StepResult], None]] = []

    # -- device -> host --------------------------------------------------------------

    def write_through(self, pages: list[bytes], device_pages: list[int], parent: bytes | None = None,
                      done: Stored | None = None) -> int:
        """Copy device pages into the host pool: -> the op id. `done(stored)`
        once agreed; until then the device pages must stay as they are."""
        op = next(self._ids)
        self._unsent.writes.append(WriteRequest(op, tuple(pages), tuple(device_pages), parent or None))
        self._writes[op] = (len(pages), done)
        return op

    def hold_writes(self) -> list[WriteRequest]:
        """Take the write-throughs not sent yet out of the next step (their
        KV may still be being computed): -> what `release_writes` puts back."""
        held, self._unsent.writes = self._unsent.writes, []
        return held

    def release_writes(self, held: list[WriteRequest]) -> None:
        self._unsent.writes = held + self._unsent.writes

    def cancel_unsent_writes(self) -> int:
        """Drop the write-throughs no step has carried yet (their device pages
        are being freed): each ends as not stored. -> how many. Sent ones are
        decided by the daemon and must be waited for (`drain_writes`)."""
        cancelled, self._unsent.writes = self._unsent.writes, []
        for write in cancelled:
            self.tally.writes_cancelled += 1
            self._end_write(write.op_id, False)
        return len(cancelled)

    def writes_in_flight(self) -> int:
        return len(self._writes)

    # -- host -> device ---------------------------------------------------------------

    def match(self, pages: list[bytes]) -> int:
        """Pages of `pages`, from the first, resident in the host pool (the
        agreed state as of the last reply, the same on every rank)."""
        return self.host.prefix(pages)

    def load(self, pages: list[bytes], device_pages: list[int], done: Landed | None = None) -> int:
        """Copy host pages into device pages: -> the op id. `done(landed)`
        once agreed (then `Client.wait_loads` waits for this rank's copy)."""
        op = next(self._ids)
        self._unsent.loads.append(LoadRequest(op, tuple(pages), tuple(device_pages)))
        self._loads[op] = (len(pages), done)
        return op

    def load_signalled(self, pages: list[bytes], device_pages: list[int],
                       signals: LoadSignals) -> tuple[int, int] | None:
        """Copy host pages into device pages, this rank's copy publishing each
        layer on `signals` as it lands: -> (op id, signal slot), or None when
        no slot is free (nothing queued). Its end is followed as any load's,
        with no `done` until one is given (`SchedulerSession.load_opened`)."""
        op = next(self._ids)
        slot = signals.claim(op)
        if not slot:
            return None
        self._unsent.loads.append(LoadRequest(op, tuple(pages), tuple(device_pages), slot))
        self._loads[op] = (len(pages), None)
        # The slot is given back when the load is decided (its copies ended on
        # every rank); one never decided (a step failed) stays taken.
        self._signal_slots[op] = (signals, slot)
        return op, slot

    def load_pending(self, op: int) -> bool:
        """Whether load `op` is sent or queued and not yet decided."""
        return op in self._loads

    # -- storage -> host ----------------------------------------------------------------

    def prefetch(self, pages: list[bytes], tokens: int, parent: bytes | None = None, *, rid: str | None = None,
                 done: Brought | None = None, hold: bool = False) -> int:
        """Bring storage pages into the host pool: -> the op id. `done(pages)`
        once ended (0: revoked). A new prefetch for request `rid` replaces its
        earlier one (released if open). With `hold` (and a `rid`), the pages
        it brought stay in the host pool until `release_hold(rid)` (or
        `release(rid)`): the request's loads are sent, or it will send none."""
        if rid is not None:
            self.release(rid)
        hold = hold and rid is not None
        op = next(self._ids)
        self._unsent.prefetches.append(PrefetchRequest(op, tuple(pages), tokens, parent or None, hold))
        self._prefetches[op] = _Prefetch(rid, done, hold)
        if rid is not None:
            self._prefetch_of[rid] = op
        return op

    def poll(self, op: int) -> None:
        """Ask the next step whether this prefetch may end now (once per step)."""
        if op not in self._unsent.prefetch_polls and all(p.op_id != op for p in self._unsent.prefetches):
            self._unsent.prefetch_polls.append(op)

    def revoke(self, op: int) -> None:
        """Ask the next step to end this prefetch; it stays open until agreed."""
        self._unsent.revokes.append(op)

    def open_prefetches(self) -> list[int]:
        """The prefetches sent and not ended, oldest first."""
        unsent = {p.op_id for p in self._unsent.prefetches}
        return [op for op in self._prefetches if op not in unsent]

    def prefetch_ended(self, rid: str) -> bool:
        """Whether the prefetch of request `rid` has ended (agreed; True if it
        has none); if not, the next step asks whether it may end now."""
        if rid in self._brought:
            return True
        op = self._prefetch_of.get(rid)
        if op is None:
            return True  # nothing was prefetched for this request
        self.poll(op)
        return False

    def prefetch_open(self, rid: str) -> bool:
        """Whether a prefetch for `rid` is asked for or open, not yet ended."""
        return rid in self._prefetch_of

    def prefetched_pages(self, rid: str) -> int:
        return self._brought.get(rid, 0)

    def take_prefetched(self, rid: str) -> int:
        """Pages the ended prefetch of `rid` brought, forgetting it."""
        return self._brought.pop(rid, 0)

    def release_hold(self, rid: str) -> None:
        """The next step releases the pages request `rid`'s ended prefetch
        holds (no-op if it holds none): its loads are sent, or it needs none."""
        if (op := self._held.pop(rid, None)) is not None:
            self._release_hold(op)

    def release_holds(self) -> None:
        """The next step releases every held prefetch's pages (a flush)."""
        for rid in list(self._held):
            self.release_hold(rid)

    def release(self, rid: str) -> None:
        """The request is gone: forget its prefetch now; one a step carried
        is revoked by the next step, one never sent is dropped, an ended
        one's pages are no longer held."""
        self.release_hold(rid)
        op = self._prefetch_of.pop(rid, None)
        self._brought.pop(rid, None)
        if op is None:
            return
        del self._prefetches[op]
        self._hits_unknown.discard(op)  # the revoke below is the step it needs
        unsent = [p for p in self._unsent.prefetches if p.op_id == op]
        if unsent:  # never sent: nothing to revoke
            self._unsent.prefetches.remove(unsent[0])
        else:
            self._unsent.prefetch_polls = [p for p in self._unsent.prefetch_polls if p != op]
            self._unsent.revokes.append(op)  # if it ended first, the revoke releases its hold

    # -- the step: taken, sent by the caller, followed ----------------------------------

    def has_unsent(self) -> bool:
        """Operations collected since the last step, which the next one carries."""
        return self._unsent.any()

    def awaits_decisions(self) -> bool:
        """Whether a round may decide something the session holds open: a
        write or load a step carried, a prefetch whose storage hit is not
        yet agreed, or one whose latest poll may still be answered; or
        something the daemon opened itself (a backup to storage of pages
        written or loaded), which only rounds decide. A
        prefetch past its hit and its poll's answer waits for the next poll
        (the daemon asks nothing of it until then), so it calls for no step:
        a request queued behind others, its prefetch open, costs no round per
        iteration. Every input is the scheduler's own calls and agreed
        replies, alike on every rank."""
        return (bool(self._writes or self._loads or self._hits_unknown or self._daemon_open)
                or self._polls_answered_by > self._step)

    def next_step(self) -> tuple[int, CacheRequests]:
        """The next step's number and the operations collected for it."""
        self._step += 1
        requests, self._unsent = self._unsent.requests(), _Unsent()
        self.tally.carried(requests)
        self._hits_unknown.update(p.op_id for p in requests.prefetches)
        for op in requests.prefetch_polls:
            if (prefetch := self._prefetches.get(op)) is not None:
                prefetch.polled = True
                self._polls_answered_by = self._step + POLL_REPLIES - 1
        return self._step, requests

    def not_taken(self, requests: CacheRequests) -> None:
        """The step that carried `requests` was taken by no rank (refused, or
        failed everywhere): what it opened ends as not done, uncounted."""
        self.tally.carried(requests, sign=-1)
        for write in requests.writes:
            self._end_write(write.op_id, False)
        for load in requests.loads:
            _, done = self._loads.pop(load.op_id)
            if load.op_id in self._signal_slots:  # no rank took it: no copy runs
                signals, slot = self._signal_slots.pop(load.op_id)
                signals.release(slot)
            if done is not None:
                done(False)
        for prefetch in requests.prefetches:
            self._end_prefetch(prefetch.op_id, 0)
        # A release is safe to send again (one of a hold gone is ignored),
        # and a hold never released is kept for thousands of steps.
        for op in requests.hold_releases:
            self._release_hold(op)

    def _release_hold(self, op: int) -> None:
        if op not in self._unsent.hold_releases:  # a step names each once
            self._unsent.hold_releases.append(op)

    def follow(self, reply: StepResult) -> StepResult:
        """Take an agreed reply: close what it decided, in the order the
        reply lists it (prefetches, writes, loads)."""
        self.tally.followed(reply)
        self.host.follow(reply)
        self._daemon_open = reply.daemon_open
        if self.decisions is not None:
            self.decisions.add(reply)
        for op in reply.prefetch_hits:
            self._hits_unknown.discard(op)
            prefetch = self._prefetches.get(op)
            if prefetch is not None and prefetch.polled and op not in reply.prefetch_revoked:
                # A poll before its hit waits at the daemon: the next round asks it.
                self._polls_answered_by = max(self._polls_answered_by, reply.step + POLL_REPLIES - 1)
        for op, pages in reply.prefetch_done.items():
            self._end_prefetch(op, pages)
        for op in reply.prefetch_revoked:
            self._end_prefetch(op, 0)
        for op in reply.write_acks:
            self.tally.write_acks += 1
            self._end_write(op, True)
        for op in reply.write_failures:
            self.tally.write_failures += 1
            self.tally.failed_write_pages += self._writes[op][0]
            self._end_write(op, False)
        for op in reply.loads:
            self._end_load(op, True)
        for op in reply.load_failures:
            self._end_load(op, False)
        for listener in self.listeners:
            listener(reply)
        return reply

    def _end_prefetch(self, op: int, pages: int) -> None:
        self._hits_unknown.discard(op)
        prefetch = self._prefetches.pop(op, None)
        if prefetch is None:
            return  # released meanwhile
        if prefetch.rid is not None:
            del self._prefetch_of[prefetch.rid]
            self._brought[prefetch.rid] = pages
            if prefetch.hold and pages:
                self._held[prefetch.rid] = op
        if prefetch.done is not None:
            prefetch.done(pages)

    def _end_write(self, op: int, stored: bool) -> None:
        _, done = self._writes.pop(op)
        if done is not None:
            done(stored)

    def _end_load(self, op: int, landed: bool) -> None:
        if op not in self._loads:
            return
        pages, done = self._loads.pop(op)
        if landed:
            self.tally.load_acks += 1
            self.tally.loaded_pages += pages
        else:
            self.tally.load_failures += 1
        try:
            if done is not None:
                done(landed)
        finally:
            # Given back after its end is known: a forward still waiting on
            # the old load would read a slot claimed again as failed.
            if op in self._signal_slots:
                signals, slot = self._signal_slots.pop(op)
                signals.release(slot)
