"""What a scheduler-side session keeps of the agreed replies: one tally of
outcomes, the decision log ranks are compared by, and the mirror of the
host pool its host matches are answered from."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from cpcache.client.messages import StepResult
from cpcache.requests import CacheRequests


@dataclass
class Tally:
    """What the session's steps carried and what was agreed of it."""

    steps: int = 0  # replies followed
    step_seconds: float = 0.0  # in the session's own sends and waits (perf_counter), whoever called them
    reply_wait_seconds: float = 0.0  # of those, waiting for a step's reply (its round, the call's way back)
    writes: int = 0  # write-throughs (device -> host) a step carried
    written_pages: int = 0
    write_acks: int = 0
    write_failures: int = 0  # nothing of these entered the host pool
    failed_write_pages: int = 0
    writes_cancelled: int = 0  # dropped before any step carried them
    loads: int = 0  # loads (host -> device) a step carried, and loads refused before one did
    load_acks: int = 0
    loaded_pages: int = 0  # of the acknowledged loads
    load_failures: int = 0
    prefetches: int = 0  # prefetches (storage -> host) a step carried
    prefetch_hits: int = 0  # prefetches told how many pages storage holds
    prefetch_done: int = 0
    prefetched_pages: int = 0  # pages the ended prefetches brought to the host pool
    prefetch_revoked: int = 0
    prefetch_polls: int = 0
    revokes: int = 0
    backups_stored: int = 0  # host -> storage, by the daemon's write policy
    backups_failed: int = 0

    def carried(self, requests: CacheRequests, sign: int = 1) -> None:
        """Count what a step carries (`sign` -1: a step not taken after all)."""
        self.writes += sign * len(requests.writes)
        self.written_pages += sign * sum(len(w.pages) for w in requests.writes)
        self.loads += sign * len(requests.loads)
        self.prefetches += sign * len(requests.prefetches)
        self.prefetch_polls += sign * len(requests.prefetch_polls)
        self.revokes += sign * len(requests.revokes)

    def followed(self, reply: StepResult) -> None:
        """Count what a reply agreed that is not about one open operation."""
        self.steps += 1
        self.prefetch_hits += len(reply.prefetch_hits)
        self.prefetch_done += len(reply.prefetch_done)
        self.prefetched_pages += sum(reply.prefetch_done.values())
        self.prefetch_revoked += len(reply.prefetch_revoked)
        stored = sum(reply.backups.values())
        self.backups_stored += stored
        self.backups_failed += len(reply.backups) - stored


@dataclass
class DecisionLog:
    """Every agreed decision this rank's scheduler took, in order, across
    attaches: ranks are compared by it (equal on every rank at every
    iteration, or the model's collectives would have parted).

    `whole_replies`: keep each reply as sent, byte for byte, rather than
    its cache decisions."""

    entries: list = field(default_factory=list)
    whole_replies: bool = False
    _session_start: int = 0

    def add(self, reply: StepResult) -> None:
        self.entries.append(reply.wire if self.whole_replies else decisions_of(reply))

    def digest(self) -> str:
        return _digest_of(self.entries)

    def begin_session(self) -> None:
        """An attach: a rank whose daemon died just after a round may lack that
        round's reply (docs/sglang-backend.md, "A daemon lost"), so logs
        are also compared session by session."""
        self._session_start = len(self.entries)

    def session(self) -> tuple[int, str]:
        """(steps, digest) since the last attach."""
        since = self.entries[self._session_start :]
        return len(since), _digest_of(since)


def decisions_of(reply: StepResult) -> tuple:
    """A reply's cache decisions, in an order that does not depend on the wire's."""
    return (reply.step, reply.round, sorted(reply.prefetch_done.items()), sorted(reply.prefetch_revoked),
            sorted(reply.write_acks), sorted(reply.write_failures), sorted(reply.loads.items()),
            sorted(reply.load_failures), reply.digest)


def _digest_of(entries: list) -> str:
    return hashlib.sha256("".join(map(repr, entries)).encode()).hexdigest()[:16]


class HostMirror:
    """The pages resident in the daemon's host pool, as of the last reply."""

    def __init__(self) -> None:
        self._pages: dict[bytes, int] = {}  # page -> its host slot (-1: not told)

    def follow(self, reply: StepResult) -> None:
        for page in reply.host_left:
            self._pages.pop(page, None)
        slots = reply.host_entered_slots or (-1,) * len(reply.host_entered)
        self._pages.update(zip(reply.host_entered, slots))

    def slots(self, pages: list[bytes]) -> list[int]:
        """The host slots of resident `pages` (as of the last reply)."""
        return [self._pages[page] for page in pages]

    def prefix(self, pages: list[bytes]) -> int:
        for i, page in enumerate(pages):
            if page not in self._pages:
                return i
        return len(pages)

    def __len__(self) -> int:
        return len(self._pages)
