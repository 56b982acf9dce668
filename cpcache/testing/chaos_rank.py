"""One rank's simulated scheduler in a chaos run (`chaos.py`), driving its
own daemon as the SGLang backend does, and what it records: per iteration,
what it sent and how it ended (`Entry`), and when a detached rank tries to
attach again (`AttachTries`, the backend's rule)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cpcache.client import Client, SchedulerSession
from cpcache.errors import CacheError
from cpcache.testing.chaos_config import MODEL, PAGE_SIZE, ChaosConfig, geometry
from cpcache.values import Reduce

VALUE_BITS = 47  # votes' values: uniform in [-2**47, 2**47)


@dataclass
class Entry:
    """What one rank did at one iteration (idle detached iterations: none)."""

    at: float  # time.time() when it began
    epoch: int | None = None
    step: int | None = None
    outcome: str = ""  # "reply <digest>" or "error <class>" ("": no step sent)
    detail: str = ""  # the error's message
    attach: str = ""  # an attach try: "attached", "failed <class>", "skipped" ("": none)
    paused: str = ""  # a scheduler pause taken here

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v not in ("", None) and k != "at"}


class AttachTries:
    """When a detached rank tries to attach again: the backend's rule
    (`CpcacheRadixCache._attach_boundary` and `_try_attach_again`): tries on
    multiples of the wait, so ranks that fell back apart try at the same
    iterations; a skipped try keeps the wait, a failed one doubles it (up to
    64 x the base)."""

    def __init__(self, base: int) -> None:
        self.base = max(1, base)
        self.wait = self.base
        self.next: int | None = 1  # the first attach, at the first iteration

    def _boundary(self, iteration: int) -> int:
        return (iteration // self.wait + 1) * self.wait

    def due(self, iteration: int) -> bool:
        return self.next is not None and iteration >= self.next

    def fell_back(self, iteration: int) -> None:
        self.wait = self.base
        self.next = self._boundary(iteration)

    def skipped(self, iteration: int) -> None:
        self.next = self._boundary(iteration)

    def failed(self, iteration: int) -> None:
        self.wait = min(self.wait * 2, 64 * self.base)
        self.next = self._boundary(iteration)

    def attached(self) -> None:
        self.next = None


def _digest(wire: bytes) -> str:
    return hashlib.sha256(wire).hexdigest()[:16]


def _error(exc: BaseException) -> tuple[str, str]:
    return f"error {type(exc).__name__}", str(exc).replace("\n", " ")[:400]


def vote_value(seed: int, iteration: int, rank: int, vote: int) -> int:
    raw = hashlib.blake2b(f"{seed}/{iteration}/{rank}/{vote}".encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") % (1 << (VALUE_BITS + 1)) - (1 << VALUE_BITS)


class ChaosRank:
    """One rank's simulated scheduler, driving its own daemon."""

    def __init__(self, cfg: ChaosConfig, rank: int, sockets: Sequence[str], aborted: threading.Event) -> None:
        """`sockets`: every rank's daemon's; `aborted`: set when the run is
        given up (a pause taken ends then)."""
        self.cfg, self.rank = cfg, rank
        self.ranks = cfg.topology.world_size
        self._aborted = aborted
        domain = cfg.topology.domain(rank).ranks
        self.client = Client(sockets[rank], timeout_s=cfg.call_timeout_s,
                             peers=[sockets[r] for r in domain if r != rank])
        self.domain_sockets = [sockets[r] for r in domain]
        from cpcache.dataplane.pools import DevicePool

        self.pool = DevicePool.create_sealed(geometry(), cfg.device_pages)
        self.session: SchedulerSession | None = None
        self.tries = AttachTries(cfg.reattach_after)
        self.log: dict[int, Entry] = {}
        self.fallbacks: list[int] = []
        self.attaches: list[int] = []  # the first attach, then every re-attach
        self.attach_failures = 0
        self.skips = 0
        self.last_skip = ""
        self.spans_s: list[float] = []  # each stretch without tiers, fallback to re-attach
        self._fallen_at: float | None = None
        self.steps_ok = 0
        self.steps_failed = 0
        self.wrong_decisions: list[str] = []
        self.busy_since: float | None = None  # monotonic: a call in progress (the watchdog reads it)
        self.busy_what = ""
        self._pause: tuple[str, float] | None = None
        self._pause_lock = threading.Lock()
        self._reset_plan()

    # -- the watchdog's view ---------------------------------------------------------------

    def _busy(self, what: str) -> None:
        self.busy_what, self.busy_since = what, time.monotonic()

    def _idle(self) -> None:
        self.busy_since = None

    # -- pauses (the injector's) -------------------------------------------------------------

    def pause(self, where: str, seconds: float) -> None:
        with self._pause_lock:
            self._pause = (where, seconds)

    def _pause_at(self, where: str, entry: Entry) -> None:
        """Take a pause asked for at this point (`any`: whichever it was)."""
        with self._pause_lock:
            if self._pause is None or (where != "any" and self._pause[0] != where):
                return
            (asked, seconds), self._pause = self._pause, None
        entry.paused = f"{asked} {seconds:.2f}s"
        self._aborted.wait(seconds)  # the fault: this scheduler does nothing for so long

    def pause_pending(self) -> bool:
        return self._pause is not None

    # -- the plan: the same on every rank at the same iteration --------------------------------

    def _reset_plan(self) -> None:
        self.free = list(range(self.cfg.device_pages - 1, -1, -1))
        self.known: list[list[bytes]] = []  # chains whose write-through was acknowledged
        self.busy_pages: set[bytes] = set()  # pages an open operation names

    def _plan(self, iteration: int, rng: random.Random) -> None:
        session = self.session
        assert session is not None
        for op in session.open_prefetches():
            if rng.random() < 0.25:
                session.revoke(op)
            else:
                session.poll(op)
        for k in range(rng.randint(0, 2)):
            n = rng.randint(1, 4)
            if len(self.free) < n + 8:
                break
            chain = [hashlib.sha256(f"chaos-{self.cfg.seed}-{iteration}-{k}-{j}".encode()).digest() for j in range(n)]
            targets = [self.free.pop() for _ in chain]
            session.write_through(chain, targets, done=functools.partial(self._written, chain, targets))
            self.busy_pages.update(chain)
        loadable = [c for c in self.known[-32:]
                    if not self.busy_pages.intersection(c) and session.host.prefix(c) == len(c)]
        rng.shuffle(loadable)
        for chain in loadable[: rng.randint(0, 1)]:
            if len(self.free) < len(chain):
                break
            targets = [self.free.pop() for _ in chain]
            session.load(chain, targets, done=functools.partial(self._loaded, chain, targets))
            self.busy_pages.update(chain)
        if rng.random() < 0.3:
            stored = [c for c in self.known[-128:]
                      if not self.busy_pages.intersection(c) and session.host.prefix(c) < len(c)]
            if stored:
                chain = rng.choice(stored)
                host = session.host.prefix(chain)
                rest = chain[host:]
                session.prefetch(rest, len(rest) * PAGE_SIZE, chain[host - 1] if host else None,
                                 done=functools.partial(self._prefetched, chain))
                self.busy_pages.update(chain)

    def _written(self, chain: list[bytes], targets: list[int], stored: bool) -> None:
        self.free.extend(targets)
        self.busy_pages.difference_update(chain)
        if stored:
            self.known.append(chain)

    def _loaded(self, chain: list[bytes], targets: list[int], _landed: bool) -> None:
        self.free.extend(targets)
        self.busy_pages.difference_update(chain)

    def _prefetched(self, chain: list[bytes], _pages: int) -> None:
        self.busy_pages.difference_update(chain)

    def _votes(self, iteration: int, rng: random.Random) -> tuple[list[tuple[int, Reduce, int]], dict[int, int]]:
        votes, expected = [], {}
        for vote in range(1, rng.randint(1, 6) + 1):
            reduce = Reduce.MIN if vote % 2 else Reduce.MAX
            values = [vote_value(self.cfg.seed, iteration, r, vote) for r in range(self.ranks)]
            votes.append((vote, reduce, values[self.rank]))
            expected[vote] = min(values) if reduce is Reduce.MIN else max(values)
        return votes, expected

    # -- one iteration ------------------------------------------------------------------

    def iterate(self, iteration: int) -> None:
        if self.session is None:
            if self.tries.due(iteration):
                self._try_attach(iteration)
            elif self.pause_pending():
                entry = self.log.setdefault(iteration, Entry(time.time()))
                self._pause_at("any", entry)
            return
        self._step(iteration)

    def _step(self, iteration: int) -> None:
        session = self.session
        assert session is not None
        rng = random.Random(self.cfg.seed * 1_000_003 + iteration)
        self._plan(iteration, rng)
        votes, expected = self._votes(iteration, rng)
        step, requests = session.next_step()
        entry = self.log[iteration] = Entry(time.time(), session.epoch, step)
        try:
            self._pause_at("before_send", entry)
            self._busy(f"step {step} (epoch {session.epoch}) sent")
            receive = self.client.step_later(step, votes, requests, session.epoch)
            self._idle()
            self._pause_at("after_send", entry)
            self._busy(f"step {step} (epoch {session.epoch}) reply")
            result = receive()
        except CacheError as exc:
            entry.outcome, entry.detail = _error(exc)
            self.steps_failed += 1
            self._fall_back(iteration)
            return
        finally:
            self._idle()
        entry.outcome = f"reply {_digest(result.wire)}"
        self.steps_ok += 1
        if result.decisions != expected:
            self.wrong_decisions.append(f"iteration {iteration} step {step}: agreed {result.decisions}, "
                                        f"expected {expected}")
        session.follow(result)

    def _fall_back(self, iteration: int) -> None:
        self.session = None
        self.fallbacks.append(iteration)
        self._fallen_at = time.monotonic()
        self.tries.fell_back(iteration)

    def _try_attach(self, iteration: int) -> None:
        entry = self.log[iteration] = Entry(time.time())
        self._pause_at("any", entry)
        from cpcache.integrations.sglang.backend import first_not_serving

        self._busy("health of the domain's daemons")
        try:
            not_serving = first_not_serving(self.domain_sockets, None)
        finally:
            self._idle()
        if not_serving:
            entry.attach, entry.detail = "skipped", f"{not_serving} not serving"
            self.last_skip = f"iteration {iteration}: {entry.detail}"
            self.skips += 1
            self.tries.skipped(iteration)
            return
        self._busy("attach")
        try:
            reply = self.client.attach(MODEL, geometry(), self.cfg.device_pages, pool_fd=self.pool.fd,
                                       placement=(self.cfg.topology, self.rank))
        except (CacheError, OSError) as exc:
            entry.attach, entry.detail = _error(exc)
            entry.attach = entry.attach.replace("error", "failed", 1)
            self.attach_failures += 1
            self.tries.failed(iteration)
            return
        finally:
            self._idle()
        # Agreed: every rank's daemon began the session. Its first step, an
        # empty one, decides the try on every rank alike (backend.attach_again).
        session = SchedulerSession(first_step=int(reply.last_step) + 1, epoch=reply.epoch)
        step, requests = session.next_step()
        entry.epoch, entry.step = reply.epoch, step
        self._busy(f"first step {step} (epoch {reply.epoch})")
        try:
            result = self.client.step(step, (), requests, reply.epoch)
        except CacheError as exc:
            entry.outcome, entry.detail = _error(exc)
            entry.attach = f"failed (first step) {type(exc).__name__}"
            self.attach_failures += 1
            self.steps_failed += 1
            self.tries.failed(iteration)
            return
        finally:
            self._idle()
        entry.outcome, entry.attach = f"reply {_digest(result.wire)}", "attached"
        self.steps_ok += 1
        session.follow(result)
        self.session = session
        self._reset_plan()
        self.tries.attached()
        self.attaches.append(iteration)
        if self._fallen_at is not None:
            self.spans_s.append(time.monotonic() - self._fallen_at)
            self._fallen_at = None

    def without_tiers_s(self) -> float:
        open_s = time.monotonic() - self._fallen_at if self._fallen_at is not None else 0.0
        return sum(self.spans_s) + open_s

    def close(self) -> None:
        self.client.close()
        with contextlib.suppress(OSError):
            os.close(self.pool.fd)  # the daemon holds its own descriptor; the mapping goes with the pool
