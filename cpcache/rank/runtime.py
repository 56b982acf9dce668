"""One rank's cache: the shared state and this rank's I/O, and the one copy
of the round over them.

`CacheRuntime` is all the stepper sees of either (docs/design.md §10: what the
replica harness runs N copies of): it checks a step, packs a round's
questions with this rank's local answers, and applies an agreed round
(`apply_round`): open the step's operations (as a whole, or one by one when
the state moved since the step was checked), apply the answers, let the
data plane forget what closed, tell the host pool's changes. It is
synchronous and keeps no order of its own: the stepper decides when each
round is packed and applied, and when the I/O starts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from cpcache.agreement.rounds import Questions, RoundInput, RoundResult
from cpcache.dataplane.local_io import LocalIO
from cpcache.errors import CacheError, InvalidArgument
from cpcache.requests import CacheRequests
from cpcache.state.intents import CopyToDevice, Decisions, Intent
from cpcache.state.machine import CacheState

log = logging.getLogger(__name__)


class Lap(Protocol):
    """Where a step's time goes (`phases.PhaseClock`)."""

    def lap(self, phase: str) -> None: ...


class _NoClock:
    def lap(self, phase: str) -> None:
        pass


@dataclass
class AppliedRound:
    """What an agreed round did on this rank."""

    decided: Decisions = field(default_factory=Decisions)
    later: list[Intent] = field(default_factory=list)  # I/O the step's answer need not wait for
    refused: CacheError | None = None  # why the step did not open as a whole (it opened one by one)


@dataclass
class CacheRuntime:
    """The shared cache state and this rank's I/O, once a pool is attached."""

    state: CacheState
    io: LocalIO
    # The pages of prefetches that ended short (agreed), by this rank's
    # reason: its read had not finished (late), or had failed (a damaged
    # page, a storage error).
    short_reads: dict[str, int] = field(default_factory=lambda: {"prefetch_late": 0, "read_failed": 0})

    @property
    def digest(self) -> int:
        return self.state.ledger.digest

    def open_questions(self) -> int:
        return self.state.open_questions()

    def check(self, requests: CacheRequests, in_pipeline: Iterable[CacheRequests] = (),
              loads_resident: bool = True) -> None:
        """Raise the error this rank refuses the step with. `in_pipeline`:
        the steps this rank took whose rounds are not applied yet (lag >= 1):
        they may open what this step polls, and nothing they open may open
        again. Without `loads_resident`, a load of pages gone since the
        scheduler looked fails on its own when its step opens."""
        prefetches: set[int] = set()
        opened: set[int] = set()
        for earlier in in_pipeline:
            prefetches.update(r.op_id for r in earlier.prefetches)
            opened.update(r.op_id for r in earlier.opened())
        clash = sorted(opened.intersection(r.op_id for r in requests.opened()))
        if clash:
            raise InvalidArgument(f"operation {clash[0]} is already opened by a step still in the pipeline")
        self.state.check(requests, expected_prefetches=prefetches, loads_resident=loads_resident)

    def pack(self, number: int, votes: Questions, digest: int, requests: CacheRequests) -> RoundInput:
        """Round `number`'s input: the step's votes and the cache's questions,
        with this rank's I/O progress as it stands now."""
        self.io.drain()
        asked, labels = self.state.questions(self.io)
        return RoundInput.pack(number, votes.concat(asked), digest, requests.fingerprint(), labels, describe(requests))

    def apply_round(self, number: int, requests: CacheRequests | None, result: RoundResult,
                    start: Callable[[list[Intent]], None], clock: Lap | None = None) -> AppliedRound:
        """Apply agreed round `number` (not rejected): open its step's `requests`
        (None: this rank has nothing of it to open), then its answers.
        `start` is given at once the I/O that cannot wait for the step's
        answer (loads: a scheduler may wait for one as soon as it is told it
        opened), and, when applying the answers fails, everything opened (it
        is in the state on every rank); the rest is returned in `later`."""
        clock = clock or _NoClock()
        applied = AppliedRound()
        state = self.state
        if requests is not None and not requests.empty():
            try:
                intents, applied.decided = state.open(number, requests)
            except CacheError as exc:
                # The state moved since the step was checked (lag >= 1): the same
                # on every rank, so each operation opens or fails on its own,
                # answered by op id, and the round's answers still apply.
                log.info("step %d no longer opens as a whole (%s); opening its operations one by one", number, exc)
                applied.refused = exc
                intents, applied.decided = state.open_each(number, requests)
            clock.lap("open")
            start([i for i in intents if isinstance(i, CopyToDevice)])
            applied.later += [i for i in intents if not isinstance(i, CopyToDevice)]
            clock.lap("io")
        try:
            decisions, intents = state.apply(result)
        except Exception:
            start(applied.later)
            raise
        applied.later += intents  # loads open only with their step's operations, above
        clock.lap("apply")
        for serial, pages in state.ledger.take_short():  # before their progress is forgotten
            self.short_reads["read_failed" if self.io.read_failed(serial) else "prefetch_late"] += pages
        self.io.forget(state.take_closed())
        applied.decided.merge(decisions)
        applied.decided.host_entered, applied.decided.host_left = state.ledger.index.take_changes()
        applied.decided.host_entered_slots = [state.ledger.index[page].slot for page in applied.decided.host_entered]
        applied.decided.daemon_open = state.daemon_open()
        return applied

    def start(self, intents: list[Intent]) -> None:
        self.io.start(intents)


def describe(requests: CacheRequests) -> tuple[str, ...]:
    """What a step opens, by op id, for naming differences in a divergence."""
    return (*(f"prefetch {r.op_id}" for r in requests.prefetches), *(f"poll {i}" for i in requests.prefetch_polls),
            *(f"revoke {i}" for i in requests.revokes), *(f"write {r.op_id}" for r in requests.writes),
            *(f"load {r.op_id}" for r in requests.loads), *(f"release {i}" for i in requests.hold_releases))
