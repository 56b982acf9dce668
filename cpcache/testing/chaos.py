"""`cpcache bench chaos`: one agreement domain of real daemons (`LocalDomain`:
real processes, real gloo, real gRPC on unix sockets) driven by one
simulated scheduler per rank, under faults at random moments and in
combination (chaos_faults.py), every rank's outcome compared step by step
(docs/design.md rule 12: a daemon's fate is never the server's).

Each rank's scheduler runs in its own thread and drives its daemon as the
SGLang backend does: the blocking `Client` constructed with `peers=` (the
other ranks' sockets, where it asks `Outcome` when its own daemon died before
answering), a `SchedulerSession` per attach, each step sent with
`step_later` and its reply taken after (as `SchedulerSession.iterate`).
The schedulers move in lockstep, one iteration at a time (a barrier stands
for the model's collectives in the forward, which hold SGLang's ranks
together), and every rank builds the same step at the same iteration from
agreed facts alone (the session's state, the iteration number): votes with
rank-dependent values (MIN and MAX; each rank checks the agreed value),
write-throughs, load-backs of pages the host pool holds, prefetches and
polls and revokes.

After a failed step a rank is detached (no tiers) and tries to attach again
at absolute iterations, as the backend's `CpcacheRadixCache` does
(`AttachTries`: a try at the next multiple of the wait, skipped while a
daemon of the domain does not serve, the wait doubled after a failed try;
the try is an `Attach` then the session's first, empty step, whose outcome
is the try's).

Each rank records, per iteration, what it sent and how it ended: the reply's
bytes (their digest) or the error's class. Checked afterwards:

- divergences: an iteration where ranks that sent a step got different
  outcomes (one a reply, another an error, or two different replies), or an
  attach try that attached some ranks and not others, each with the ranks,
  their outcomes and the faults that came before it;
- hangs: a call (step, attach) that did not return within `hang_s`, or the
  ranks never meeting again at an iteration;
- the iterations each rank fell back and attached again, compared;
- wrong decisions: an agreed vote other than the MIN or MAX of every rank's value.

Exit status 0 iff no divergence and no hang (nor a wrong decision, nor an
error of the harness itself).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cpcache.client import Client, SchedulerSession
from cpcache.client.connection import DEADLINE_MARGIN_S, check_deadline
from cpcache.client.core import OUTCOME_WAIT_S
from cpcache.errors import CacheError, InvalidArgument
from cpcache.testing.chaos_faults import COMBINED, KINDS, DomainHost, Injector
from cpcache.topology import Topology
from cpcache.values import Reduce

if TYPE_CHECKING:
    from cpcache.daemon.launcher import DomainSpec
    from cpcache.geometry import KVGeometry

# The command line parses without torch: what needs it is imported when a run starts.
MODEL = "chaos"
PAGE_SIZE = 16


@functools.cache
def geometry() -> KVGeometry:
    from cpcache.geometry import KVGeometry

    return KVGeometry(layers=2, kv_kind="mha", heads=1, head_dim=16, dtype="bfloat16", page_size=PAGE_SIZE)
VALUE_BITS = 47  # votes' values: uniform in [-2**47, 2**47)
# Per-rank perturbation (rank % 4): (storage delay ms, copy delay ms), so that
# operations are open, and ranks' I/O ends at different times, when a fault lands.
RANK_DELAYS = {0: (0.0, 0.0), 1: (20.0, 4.0), 2: (5.0, 1.0), 3: (10.0, 2.0)}


@dataclass
class ChaosConfig:
    tp: int = 4
    cp: int = 2
    minutes: float = 1.5
    seed: int = 1
    agreement_timeout_s: float = 2.0
    call_timeout_s: float = 8.0  # the schedulers' call deadline: above the agreement timeout + 5 s
    fault_every_s: float = 8.0
    kinds: tuple[str, ...] = KINDS
    iteration_ms: float = 10.0  # the shortest scheduler iteration (a forward pass)
    reattach_after: int = 16  # the backend's reattach_after_iterations
    settle_s: float = 180.0  # after the faults, longest wait for every rank to be attached again (beyond the
    # daemons' own rendezvous_timeout_s, 120 s: a domain forming again may take that long)
    device_pages: int = 256
    host_pool_pages: int = 64
    flood_streams: int = 256
    flood_calls: int = 64
    hang_s: float = 0.0  # 0: call_timeout_s x (2 + ranks) + OUTCOME_WAIT_S + 30
    run_dir: Path | None = None
    keep_run_dir: bool = False

    @property
    def topology(self) -> Topology:
        return Topology(tp=self.tp, cp=self.cp)


# -- what a rank records ---------------------------------------------------------------------


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


# -- one rank's scheduler -------------------------------------------------------------------------


class ChaosRank:
    """One rank's simulated scheduler, driving its own daemon."""

    def __init__(self, run: ChaosRun, rank: int) -> None:
        cfg = run.cfg
        self.run, self.cfg, self.rank = run, cfg, rank
        sockets = run.host.sockets
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
        self.run.aborted.wait(seconds)  # the fault: this scheduler does nothing for so long

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
            values = [vote_value(self.cfg.seed, iteration, r, vote) for r in range(self.run.ranks)]
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


# -- the run --------------------------------------------------------------------------------


def domain_spec(cfg: ChaosConfig, run_dir: Path) -> DomainSpec:
    from cpcache.daemon.launcher import DomainSpec

    per_rank = {rank: dict(fault_storage_delay_ms=RANK_DELAYS[rank % 4][0],
                           fault_copy_delay_ms=RANK_DELAYS[rank % 4][1], fault_seed=cfg.seed * 100 + rank)
                for rank in range(cfg.topology.world_size)}
    return DomainSpec(cfg.topology, run_dir, agreement_timeout_s=cfg.agreement_timeout_s, seed=cfg.seed,
                      extra=dict(storage="file", storage_root=str(run_dir / "pages"),
                                 host_pool_pages=cfg.host_pool_pages, prefetch_threshold_tokens=PAGE_SIZE),
                      per_rank=per_rank)


class ChaosRun:
    def __init__(self, cfg: ChaosConfig, run_dir: Path) -> None:
        if len(cfg.topology.domains()) != 1:
            raise InvalidArgument(f"chaos: --tp {cfg.tp} --cp {cfg.cp} is more than one agreement domain")
        check_deadline(cfg.call_timeout_s, cfg.agreement_timeout_s)
        self.cfg = cfg
        self.run_dir = run_dir
        self.ranks = cfg.topology.world_size
        self.hang_s = cfg.hang_s or cfg.call_timeout_s * (2 + self.ranks) + OUTCOME_WAIT_S + 30
        self.host = DomainHost(domain_spec(cfg, run_dir))
        self.aborted = threading.Event()
        self.iteration = 0
        self.phase = "run"  # then "settle" (no more faults), then "stop"
        self.settled = False
        self.hangs: list[dict[str, Any]] = []
        self.harness_errors: list[str] = []
        self._next_at = 0.0
        self._deadline = 0.0
        self._settle_until = 0.0
        self._aborted_at = 0.0
        self.began = time.time()

    def _between(self) -> None:
        """Between two iterations, every rank waiting (the barrier's action):
        paces the iterations and decides, for every rank alike, what comes next."""
        now = time.monotonic()
        if self._next_at > now:
            time.sleep(self._next_at - now)  # an iteration lasts at least iteration_ms, as a forward pass does
        now = time.monotonic()
        self._next_at = now + self.cfg.iteration_ms / 1000
        self.iteration += 1
        if self.phase == "run" and now >= self._deadline:
            self.phase = "settle"
            self.injector.halt.set()
            self._settle_until = now + self.cfg.settle_s
        elif self.phase == "settle":
            quiet = not self.injector.is_alive() and not any(r.pause_pending() for r in self.schedulers)
            self.settled = quiet and all(r.session is not None for r in self.schedulers)
            if self.settled or now >= self._settle_until:
                self.phase = "stop"

    def _loop(self, rank: ChaosRank) -> None:
        try:
            while True:
                try:
                    self.barrier.wait()
                except threading.BrokenBarrierError:
                    if not self.aborted.is_set():
                        self._hang(rank, "the ranks did not meet at the next iteration", self.barrier_s)
                    return
                if self.phase == "stop":
                    return
                rank.iterate(self.iteration)
        except Exception as exc:  # a bug of the harness
            self.harness_errors.append(f"rank {rank.rank} at iteration {self.iteration}: {type(exc).__name__}: {exc}")
            self.abort()

    def abort(self) -> None:
        self.aborted.set()
        self.phase = "stop"
        self.barrier.abort()

    def _hang(self, rank: ChaosRank, what: str, seconds: float) -> None:
        self.hangs.append({"rank": rank.rank, "iteration": self.iteration, "what": what,
                           "seconds": round(seconds, 1), "t_s": round(time.time() - self.began, 2)})

    def execute(self) -> dict[str, Any]:
        cfg = self.cfg
        started = time.monotonic()
        self.host.start()
        ready_s = time.monotonic() - started
        self.schedulers = [ChaosRank(self, r) for r in range(self.ranks)]
        self.barrier_s = self.hang_s + 1.3 * cfg.call_timeout_s + 30
        self.barrier = threading.Barrier(self.ranks, action=self._between, timeout=self.barrier_s)
        self.injector = Injector(self.host, seed=cfg.seed, kinds=cfg.kinds, every_s=cfg.fault_every_s,
                                 agreement_s=cfg.agreement_timeout_s, call_timeout_s=cfg.call_timeout_s,
                                 pause_scheduler=lambda r, where, s: self.schedulers[r].pause(where, s),
                                 iteration=lambda: self.iteration, flood_streams=cfg.flood_streams,
                                 flood_calls=cfg.flood_calls)
        threads = [threading.Thread(target=self._loop, args=(r,), name=f"chaos-rank-{r.rank}", daemon=True)
                   for r in self.schedulers]
        self.began = time.time()
        self._deadline = time.monotonic() + cfg.minutes * 60
        for thread in threads:
            thread.start()
        self.injector.start()
        flagged: set[tuple[int, float]] = set()
        try:
            while any(t.is_alive() for t in threads):
                for thread in threads:
                    thread.join(0.25)
                now = time.monotonic()
                if self.aborted.is_set():
                    self._aborted_at = self._aborted_at or now
                    if now - self._aborted_at > 15:  # a hung call's thread is left behind
                        break
                for rank in self.schedulers:
                    since = rank.busy_since
                    if since is not None and now - since > self.hang_s and (rank.rank, since) not in flagged:
                        flagged.add((rank.rank, since))
                        self._hang(rank, rank.busy_what, now - since)
                        self.abort()
            ran_s = time.time() - self.began
            at_end = self._daemons_now()
        finally:
            self.injector.halt.set()
            self.injector.join(cfg.call_timeout_s * 3 + 30)
            codes = self.host.stop()
            for rank in self.schedulers:
                rank.close()
        report = self.report(ran_s, ready_s)
        report["daemons_at_end"] = at_end
        report["daemon_exit_codes_at_stop"] = codes
        if not self.settled:
            # The faults ended settle_s ago and some rank is still without
            # tiers: its domain did not serve again (a hang of the tiers).
            why = {str(r.rank): r.last_skip for r in self.schedulers if r.session is None}
            report["hang_list"].append({"rank": -1, "iteration": self.iteration, "t_s": round(ran_s, 2),
                                        "what": f"ranks {report['without_tiers_s']['still_without_at_end']} not "
                                                f"attached again {cfg.settle_s:g} s after the last fault; last "
                                                f"skipped tries: {why}", "seconds": cfg.settle_s})
            report["hangs"] = len(report["hang_list"])
            report["ok"] = False
        return report

    def _daemons_now(self) -> dict[str, Any]:
        """Each daemon's health, state and epoch, as the run ends."""
        from cpcache.testing.daemon_probe import what_is_open

        out: dict[str, Any] = {}
        for rank, socket in enumerate(self.host.sockets):
            with Client(socket, timeout_s=2.0) as daemon:
                health: int | str
                try:
                    health = daemon.health()
                except CacheError as exc:
                    health = type(exc).__name__
            seen = what_is_open(socket, timeout_s=2.0)
            out[str(rank)] = {"pid": self.host.pid(rank), "health": health,
                              **{k: seen[k] for k in ("state", "epoch", "attached", "error") if k in seen}}
        return out

    # -- the report ---------------------------------------------------------------------

    def report(self, ran_s: float, ready_s: float) -> dict[str, Any]:
        cfg, ranks = self.cfg, self.schedulers
        faults = self.injector.faults
        compared = compare(ranks, [f.as_dict(self.began) for f in faults], self.began, cfg.call_timeout_s)
        fallbacks = {str(r.rank): r.fallbacks for r in ranks}
        reattaches = {str(r.rank): r.attaches[1:] for r in ranks}
        spans = [s for r in ranks for s in r.spans_s]
        wrong = [f"rank {r.rank}: {w}" for r in ranks for w in r.wrong_decisions]
        lives = self.host.lives
        report: dict[str, Any] = {
            "topology": cfg.topology.describe(), "ranks": self.ranks, "seed": cfg.seed, "minutes": cfg.minutes,
            "agreement_timeout_s": cfg.agreement_timeout_s, "call_timeout_s": cfg.call_timeout_s,
            "hang_s": self.hang_s, "fault_every_s": cfg.fault_every_s, "ready_s": round(ready_s, 1),
            "ran_s": round(ran_s, 1), "iterations": self.iteration, "settled": self.settled,
            **compared,
            "steps_sent": sum(r.steps_ok + r.steps_failed for r in ranks),
            "faults": len(faults), "faults_by_kind": dict(Counter(f.kind for f in faults)),
            "faults_combined": sum(f.combined for f in faults),
            "faults_missed_actions": sum(len(f.missed) for f in faults),
            "hangs": len(self.hangs), "hang_list": self.hangs,
            "wrong_decisions": len(wrong), "wrong_decision_list": wrong[:10],
            "fallbacks": fallbacks, "reattaches": reattaches,
            "fallbacks_match": len({tuple(v) for v in fallbacks.values()}) == 1,
            "reattaches_match": len({tuple(v) for v in reattaches.values()}) == 1,
            "fallback_differences": differences(fallbacks), "reattach_differences": differences(reattaches),
            "per_rank": {str(r.rank): {"steps_ok": r.steps_ok, "steps_failed": r.steps_failed,
                                       "fallbacks": len(r.fallbacks), "reattaches": len(r.attaches[1:]),
                                       "attach_failures": r.attach_failures, "attach_skips": r.skips,
                                       "without_tiers_s": round(r.without_tiers_s(), 1)} for r in ranks},
            "without_tiers_s": {"total": round(sum(spans), 1), "max": round(max(spans, default=0.0), 1),
                                "mean": round(sum(spans) / len(spans), 2) if spans else 0.0,
                                "still_without_at_end": [r.rank for r in ranks if r.session is None]},
            "daemon_exits": {str(r): dict(Counter(str(x.code) for x in lives if x.rank == r))
                             for r in range(self.ranks)},
            "daemon_restarts": sum(x.back_s is not None for x in lives),
            "daemon_back_s_max": max((x.back_s for x in lives if x.back_s is not None), default=0.0),
            "armed_lives": [{"rank": x.rank, "armed": x.armed} for x in lives if x.armed],
            "harness_errors": self.harness_errors + self.injector.errors,
            "fault_list": with_episodes([f.as_dict(self.began) for f in faults], fallbacks, reattaches),
        }
        report["ok"] = (report["divergences"] == 0 and report["hangs"] == 0 and report["wrong_decisions"] == 0
                        and not report["harness_errors"])
        return report


def with_episodes(rows: list[dict[str, Any]], fallbacks: dict[str, list[int]],
                  reattaches: dict[str, list[int]]) -> list[dict[str, Any]]:
    """Each fault with the iterations each rank fell back at, from the
    fault's iteration until the next fault's, and attached again at after
    each of those (-1: not by the end); and whether it landed while some rank
    was without tiers."""

    def back(rank: str, fell: int) -> int:
        return next((i for i in reattaches[rank] if i > fell), -1)

    for k, row in enumerate(rows):
        lo, hi = row["iteration"], rows[k + 1]["iteration"] if k + 1 < len(rows) else 1 << 62
        fell = {r: [i for i in its if lo <= i < hi] for r, its in fallbacks.items()}
        came = {r: [back(r, i) for i in its] for r, its in fell.items()}
        row["fallback_iterations"] = {r: its for r, its in fell.items() if its}
        row["reattach_iterations"] = {r: its for r, its in came.items() if its}
        row["fallback_differs"] = len({tuple(its) for its in fell.values()}) > 1
        row["reattach_differs"] = len({tuple(its) for its in came.values()}) > 1
        row["during_fallback"] = any(i < lo and (back(r, i) == -1 or back(r, i) > lo)
                                     for r, its in fallbacks.items() for i in its)
    return rows


def differences(per_rank: dict[str, list[int]]) -> list[dict[str, Any]]:
    """The iterations in some ranks' lists but not in every rank's: which ranks have them."""
    every = set.intersection(*(set(v) for v in per_rank.values())) if per_rank else set()
    apart = sorted(set().union(*per_rank.values()) - every)
    return [{"iteration": i, "ranks": [int(r) for r, v in per_rank.items() if i in v]} for i in apart][:20]


def compare(ranks: list[ChaosRank], faults: list[dict[str, Any]], began: float, window_s: float) -> dict[str, Any]:
    """Every iteration's outcomes across the ranks that sent a step (or tried
    to attach) at it."""
    iterations = sorted(set().union(*(r.log for r in ranks)))
    divergent: list[dict[str, Any]] = []
    counts: Counter[str] = Counter()
    for i in iterations:
        entries = {r.rank: r.log[i] for r in ranks if i in r.log}
        sent = {rank: e for rank, e in entries.items() if e.outcome}
        if sent:
            counts["steps"] += 1
            counts["steps_compared"] += len(sent) > 1
            counts["steps_sent_apart"] += len(sent) < len(ranks)
        replies = {e.outcome for e in sent.values() if e.outcome.startswith("reply")}
        failed = sorted(rank for rank, e in sent.items() if e.outcome.startswith("error"))
        tried = {rank: e.attach for rank, e in entries.items() if e.attach and e.attach != "skipped"}
        attached = sorted(rank for rank, a in tried.items() if a == "attached")
        kinds = []
        if replies and (failed or len(replies) > 1):
            kinds.append("step")
        elif replies:
            counts["steps_replied_alike"] += 1
        elif sent:
            counts["steps_failed_alike"] += 1
        if tried:
            counts["attach_tries"] += 1
            if attached and len(attached) < len(tried):
                kinds.append("attach")
            if len(tried) < len(entries):
                counts["attach_tries_apart"] += 1  # some ranks skipped a try their peers made
        if not kinds:
            continue
        at = min(e.at for e in entries.values())
        divergent.append({
            "iteration": i, "kind": "+".join(kinds), "t_s": round(at - began, 2),
            "applied": sorted(rank for rank, e in sent.items() if e.outcome.startswith("reply")), "failed": failed,
            "attached": attached, "not_attached": sorted(set(tried) - set(attached)),
            "outcomes": {str(rank): e.as_dict() for rank, e in sorted(entries.items())},
            "faults_before": [f["n"] for f in faults if f["t_s"] <= at - began + 0.5
                              and f["t_s"] + f["lasted_s"] >= at - began - 4 * window_s][-4:],
        })
        divergent[-1]["cause"] = cause(entries)
        divergent[-1]["scenario"] = scenario(divergent[-1], faults)
    return {"steps": counts["steps"], "steps_compared": counts["steps_compared"],
            "steps_replied_alike": counts["steps_replied_alike"], "steps_failed_alike": counts["steps_failed_alike"],
            "steps_sent_apart": counts["steps_sent_apart"], "attach_tries": counts["attach_tries"],
            "attach_tries_apart": counts["attach_tries_apart"],
            "divergences": len(divergent), "divergences_by_cause": dict(Counter(d["cause"] for d in divergent)),
            "divergent_steps": divergent[:50]}


def cause(entries: dict[int, Entry]) -> str:
    """What the failed ranks' errors say of a split step:
    - `recovery_no_peer`: a rank whose daemon gave no answer found no peer's
      daemon that could tell how the step ended, and failed it alone;
    - `round_split`: the round itself ended apart: some daemons completed
      it while others failed it (a peer lost mid-collective), each rank told
      by its own daemon or by the peer it asked;
    - `other`."""
    details = [e.detail for e in entries.values() if e.outcome.startswith("error")]
    if any("could tell how step" in d for d in details):
        return "recovery_no_peer"
    if details and all(f"round {e.step} failed" in e.detail for e in entries.values()
                       if e.outcome.startswith("error") and e.step is not None):
        return "round_split"
    return "other"


def scenario(divergence: dict[str, Any], faults: list[dict[str, Any]]) -> str:
    """One line: the faults before a divergence, and how each rank ended the step."""
    by_number = {f["n"]: f for f in faults}
    before = "; ".join(f"fault {n} {by_number[n]['kind']} at {by_number[n]['t_s']}s (" +
                       ", ".join(a.split(" ", 1)[1] for a in by_number[n]["actions"]) + ")"
                       for n in divergence["faults_before"])
    ends = ", ".join(f"r{r} {o.get('attach', '') or ''}{' ' if o.get('attach') else ''}"
                     f"{o.get('outcome', '-')}" + (f" (epoch {o['epoch']} step {o['step']})" if "step" in o else "")
                     for r, o in divergence["outcomes"].items())
    return f"after {before or 'no fault'}: iteration {divergence['iteration']} at {divergence['t_s']}s: {ends}"


def run_chaos(cfg: ChaosConfig) -> dict[str, Any]:
    """Run the chaos bench; -> its report. The run dir (logs) is kept when it failed."""
    run_dir = cfg.run_dir or Path(tempfile.mkdtemp(prefix="cpchaos-"))
    report = ChaosRun(cfg, run_dir).execute()
    report["run_dir"] = str(run_dir)
    if report["ok"] and cfg.run_dir is None and not cfg.keep_run_dir:
        shutil.rmtree(run_dir, ignore_errors=True)
        report["run_dir"] = None
    return report


# -- the command line -------------------------------------------------------------------------


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"fault kinds are {', '.join(KINDS)}; got {text!r}")
    return kinds


def _add(group: Any, parser: argparse.ArgumentParser, flag: str, **kwargs: Any) -> None:
    """Add `flag` unless the parser has it already (bench shares --seed,
    --minutes, --json with other benches)."""
    if flag not in parser._option_string_actions:
        group.add_argument(flag, **kwargs)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """chaos's flags (those another bench added already are shared)."""
    d = ChaosConfig()
    group = parser.add_argument_group("chaos")
    _add(group, parser, "--tp", type=int, default=d.tp, help="chaos: tensor-parallel size (one domain: --tp 8 --cp 8)")
    _add(group, parser, "--cp", type=int, default=d.cp, help="chaos: attention context-parallel size")
    _add(group, parser, "--minutes", type=float, default=d.minutes, help="chaos: how long faults are injected")
    _add(group, parser, "--seed", type=int, default=d.seed, help="chaos: seed of the steps and the faults")
    _add(group, parser, "--json", action="store_true", help="print one JSON object")
    group.add_argument("--chaos-agreement-timeout-s", type=float, default=d.agreement_timeout_s,
                       help="chaos: the daemons' agreement_timeout_s")
    group.add_argument("--chaos-call-timeout-s", type=float, default=d.call_timeout_s,
                       help=f"chaos: the schedulers' call deadline (above the agreement timeout + "
                       f"{DEADLINE_MARGIN_S:g} s)")
    group.add_argument("--chaos-fault-every-s", type=float, default=d.fault_every_s,
                       help="chaos: a fault every uniform(0.75, 1.25) x this many seconds after the last ended")
    group.add_argument("--chaos-kinds", type=_kinds, default=d.kinds, metavar="KIND,...",
                       help=f"chaos: the faults dealt (default: all of {', '.join(KINDS)})")
    group.add_argument("--chaos-settle-s", type=float, default=d.settle_s,
                       help="chaos: after the faults, longest wait for every rank to attach again")
    group.add_argument("--chaos-run-dir", help="chaos: where sockets, logs and pages go (kept)")


def config_of(args: argparse.Namespace) -> ChaosConfig:
    return ChaosConfig(tp=args.tp, cp=args.cp, minutes=args.minutes, seed=args.seed,
                       agreement_timeout_s=args.chaos_agreement_timeout_s, call_timeout_s=args.chaos_call_timeout_s,
                       fault_every_s=args.chaos_fault_every_s, kinds=tuple(args.chaos_kinds),
                       settle_s=args.chaos_settle_s,
                       run_dir=Path(args.chaos_run_dir) if args.chaos_run_dir else None)


def text_report(report: dict[str, Any]) -> str:
    lines = ["  #    t_s  iter  kind                   ranks  open / actions"]
    for f in report["fault_list"]:
        opened = " ".join(f"r{r}:{','.join(v)}" for r, v in f["open"].items())
        lines.append(f"{f['n']:3d} {f['t_s']:6.1f} {f['iteration']:5d}  {f['kind']:<22} "
                     f"{','.join(map(str, f['ranks'])):<6} {opened}  fell back {_its(f['fallback_iterations'])}"
                     f"  attached again {_its(f['reattach_iterations'])}"
                     + ("  DIFFERS" if f["fallback_differs"] or f["reattach_differs"] else "")
                     + ("  (during a fallback)" if f["during_fallback"] else ""))
        lines += [f"{'':42}{a}" for a in f["actions"]]
    for d in report["divergent_steps"]:
        lines.append(f"DIVERGENCE at iteration {d['iteration']} ({d['kind']}, {d['cause']}, t={d['t_s']}s, after "
                     f"faults {d['faults_before']}): applied {d['applied']} failed {d['failed']}")
        lines.append(f"    {d['scenario']}")
        lines += [f"    rank {r}: {o}" for r, o in d["outcomes"].items()]
    for h in report["hang_list"]:
        lines.append(f"HANG rank {h['rank']} at iteration {h['iteration']}: {h['what']} ({h['seconds']} s)")
    skip = {"fault_list", "divergent_steps", "hang_list"}
    lines += [f"{key}: {value}" for key, value in report.items() if key not in skip]
    lines.append("OK" if report["ok"] else "FAILED")
    return "\n".join(lines)


def _its(per_rank: dict[str, list[int]]) -> str:
    """`0-3:987` when every rank listed has the same iterations, else `0:987 1:990`."""
    if not per_rank:
        return "-"
    values = {tuple(v) for v in per_rank.values()}
    if len(values) == 1:
        return f"{','.join(per_rank)}:{','.join(map(str, values.pop()))}"
    return " ".join(f"{r}:{','.join(map(str, v))}" for r, v in per_rank.items())


def main(args: argparse.Namespace) -> int:
    try:
        cfg = config_of(args)
        check_deadline(cfg.call_timeout_s, cfg.agreement_timeout_s)
    except InvalidArgument as exc:
        print(f"chaos: {exc}", file=sys.stderr)
        return 2
    report = run_chaos(cfg)
    print(json.dumps(report) if args.json else text_report(report), flush=True)
    if not report["ok"]:
        print(f"chaos: FAILED (logs in {report['run_dir']})", file=sys.stderr)
    return 0 if report["ok"] else 1


__all__ = ["COMBINED", "KINDS", "ChaosConfig", "add_flags", "main", "run_chaos"]
