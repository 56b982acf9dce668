"""The faults of `cpcache bench chaos` (chaos.py), and the daemons they hit.

`DomainHost` runs a `LocalDomain` on an event loop of its own thread, with a
supervisor per rank that starts a daemon again whenever it exits, as `cpcache
launch` does (with whatever code; never a settings error, exit 2), with the
same settings, or, for one life only, with an armed exact-moment fault
(`fault_exit_after_round`, `fault_exit_after_attach`).

`Injector` deals faults at random moments from a seeded, shuffled deck, one
after the other, each on random ranks:

single faults
- `daemon_sigkill`, `daemon_sigterm`: the daemon is killed, or stopped
  gracefully (it drains); the supervisor starts it again;
- `daemon_sigstop`: SIGSTOP for uniform(0.5, 2) x the agreement timeout, then SIGCONT;
- `scheduler_pause`: the rank's scheduler stops for uniform(0.5, 1.3) x its
  call deadline, either before it sends its step (its peers wait in the
  round) or with its step sent and its reply not taken (the deadline passes:
  the client sends it again);
- `flood`: many `Steps` streams opened on the daemon and left idle, and many
  `Status` calls, for uniform(1, 3) x the agreement timeout;

combined faults
- `two_daemons`: two ranks' daemons, each killed, stopped gracefully or SIGSTOPped, at once;
- `kill_while_stopped`: one rank's daemon SIGSTOPped (or its scheduler
  paused), and while it is, another rank's daemon killed;
- `term_during_reform`: one daemon killed, and while the domain forms again
  (within 1.5 x the agreement timeout) another stopped gracefully;
- `kill_mid_drain`: a daemon stopped gracefully, and while it drains, it or
  another rank's daemon killed;
- `kill_then_round_exit`: a daemon killed, and its next life armed to die
  between the round of step N (1 to 3: 1 is the attach try's first step) of
  its first session and its reply (`fault_exit_after_round`);
- `kill_two_then_round_exit`: two daemons killed at once, and the next
  life of each armed to die between the round of the same step N and its reply;
- `kill_then_attach_exit`: a daemon killed, and its next life armed to die
  once its first Attach is agreed, before answering it (`fault_exit_after_attach`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from cpcache.client.connection import CHANNEL_OPTIONS, target_of
from cpcache.errors import CacheError
from cpcache.testing.daemon_probe import open_labels, what_is_open
from cpcache.v1 import daemon_pb2 as pb
from cpcache.v1 import daemon_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from cpcache.daemon.launcher import DomainSpec

SINGLE = ("daemon_sigkill", "daemon_sigterm", "daemon_sigstop", "scheduler_pause", "flood")
COMBINED = ("two_daemons", "kill_while_stopped", "term_during_reform", "kill_mid_drain", "kill_then_round_exit",
            "kill_two_then_round_exit", "kill_then_attach_exit")
KINDS = SINGLE + COMBINED
STREAMS_PER_CHANNEL = 64  # a flood's calls per connection (HTTP/2 caps the streams of one)


# -- the daemons --------------------------------------------------------------------------


@dataclass
class DaemonLife:
    rank: int
    exited_at: float  # time.time()
    code: int
    armed: dict[str, Any]  # the settings the next life was started with, beyond the domain's
    back_s: float | None = None  # how long until the next life served (None: it did not)


class DomainHost:
    """A `LocalDomain` on an event loop of its own thread, its daemons
    started again whenever they exit (as `cpcache launch` does)."""

    def __init__(self, spec: DomainSpec, start_timeout_s: float = 180.0) -> None:
        from cpcache.daemon.launcher import LocalDomain  # torch: not at the command line's parse

        self.spec = spec
        self.base = {rank: dict(settings) for rank, settings in spec.per_rank.items()}
        self.domain = LocalDomain(spec, start_timeout_s=start_timeout_s)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="chaos-domain", daemon=True)
        self._supervisors: list[asyncio.Task] = []
        self._armed: dict[int, dict[str, Any]] = {}
        self.lives: list[DaemonLife] = []
        self.closing = False

    def _run(self, coroutine: Any) -> Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def start(self) -> None:
        self._thread.start()
        self._run(self._start()).result()

    async def _start(self) -> None:
        await self.domain.start()
        self._supervisors = [asyncio.ensure_future(self._supervise(r)) for r in range(self.domain.size)]

    @property
    def sockets(self) -> list[str]:
        return self.domain.sockets

    def arm(self, rank: int, settings: dict[str, Any]) -> None:
        """`rank`'s next daemon (not the one running) starts with these settings too."""
        self._armed[rank] = settings

    async def _supervise(self, rank: int) -> None:
        domain = self.domain
        while not self.closing:
            code = await asyncio.shield(domain.exited(rank))
            if self.closing or code == 2:
                return
            armed = self._armed.pop(rank, {})
            life = DaemonLife(rank, time.time(), code, armed)
            self.lives.append(life)
            self.spec.per_rank[rank] = {**self.base.get(rank, {}), **armed}
            seen = time.monotonic()
            domain.respawn(rank)
            try:
                await domain.wait_serving(rank)
            except CacheError:
                if not domain.exited(rank).done():
                    try:
                        await asyncio.wait_for(asyncio.shield(domain.exited(rank)), domain.start_timeout_s)
                    except TimeoutError:
                        domain.signal(rank, signal.SIGKILL)
                continue
            life.back_s = round(time.monotonic() - seen, 2)

    def pid(self, rank: int) -> int | None:
        proc = self.domain.procs[rank]
        return proc.pid if proc.poll() is None else None

    def signal(self, rank: int, sig: int) -> int | None:
        """-> the pid signalled (None: no daemon of `rank` runs now)."""
        pid = self.pid(rank)
        if pid is None:
            return None
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return None
        return pid

    def flood(self, rank: int, streams: int, calls: int, hold_s: float) -> dict[str, int]:
        return self._run(self._flood(self.sockets[rank], streams, calls, hold_s)).result()

    async def _flood(self, socket: str, streams: int, calls: int, hold_s: float) -> dict[str, int]:
        """`streams` `Steps` streams opened and left idle, and `calls`
        callers of `Status` one call after the other, for `hold_s`, over
        several connections."""
        options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
        channels = [grpc.aio.insecure_channel(target_of(socket), options=options)
                    for _ in range(max(1, -(-(streams + calls) // STREAMS_PER_CHANNEL)))]
        stubs = [pb_grpc.CacheDaemonStub(c) for c in channels]
        counts = {"streams": streams, "calls": 0, "calls_refused": 0, "calls_failed": 0}
        until = time.monotonic() + hold_s
        opened = [stubs[i % len(stubs)].Steps() for i in range(streams)]

        async def caller(stub: Any) -> None:
            while time.monotonic() < until:
                try:
                    await stub.Status(pb.StatusRequest(), timeout=2.0)
                    counts["calls"] += 1
                except grpc.aio.AioRpcError as exc:
                    key = "calls_refused" if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else "calls_failed"
                    counts[key] += 1
                    await asyncio.sleep(0.05)  # a refused caller does not spin

        try:
            await asyncio.wait_for(asyncio.gather(*(caller(stubs[(streams + i) % len(stubs)])
                                                    for i in range(calls))), hold_s + 5)
        except TimeoutError:
            pass
        finally:
            for call in opened:
                call.cancel()
            for channel in channels:
                await channel.close()
        return counts

    def stop(self) -> list[int | None]:
        self.closing = True

        async def stop() -> list[int | None]:
            for task in self._supervisors:
                task.cancel()
            await asyncio.gather(*self._supervisors, return_exceptions=True)
            return await self.domain.stop()

        try:
            return self._run(stop()).result(timeout=self.spec.agreement_timeout_s + 60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            if not self._thread.is_alive():
                self.loop.close()  # its self-pipe too: nothing left for the garbage collector to warn of


# -- the faults ---------------------------------------------------------------------------


@dataclass
class Fault:
    number: int
    kind: str
    ranks: list[int]
    at: float  # time.time() of its first action
    iteration: int  # the schedulers' iteration when it began
    seen: dict[int, list[str]] = field(default_factory=dict)  # rank -> what its daemon had open (open_labels)
    actions: list[str] = field(default_factory=list)  # "+0.00s r1 SIGKILL pid 123", in order
    ended: float = 0.0
    missed: list[str] = field(default_factory=list)  # actions that found no process
    flood: dict[str, int] = field(default_factory=dict)

    @property
    def combined(self) -> bool:
        return self.kind in COMBINED

    def as_dict(self, began: float) -> dict[str, Any]:
        return {"n": self.number, "kind": self.kind, "combined": self.combined, "ranks": self.ranks,
                "t_s": round(self.at - began, 2), "lasted_s": round(self.ended - self.at, 2),
                "iteration": self.iteration, "open": {str(r): v for r, v in self.seen.items()},
                "actions": self.actions, "missed": self.missed, **({"flood": self.flood} if self.flood else {})}


def _nothing() -> None:
    pass


PauseScheduler = Callable[[int, str, float], None]  # (rank, where, seconds)


class Injector(threading.Thread):
    """One fault at a time until `halt`, each uniform(0.75, 1.25) x
    `every_s` after the last ended, kinds dealt from a shuffled deck."""

    def __init__(self, host: DomainHost, *, seed: int, kinds: Sequence[str], every_s: float, agreement_s: float,
                 call_timeout_s: float, pause_scheduler: PauseScheduler, iteration: Callable[[], int],
                 flood_streams: int, flood_calls: int) -> None:
        super().__init__(name="chaos-faults", daemon=True)
        self.host = host
        self.rng = random.Random(seed * 7919 + 1)
        self.kinds = tuple(kinds)
        self.every_s, self.agreement_s, self.call_timeout_s = every_s, agreement_s, call_timeout_s
        self.pause_scheduler = pause_scheduler
        self.iteration = iteration
        self.flood_streams, self.flood_calls = flood_streams, flood_calls
        self.ranks = host.domain.size
        self.halt = threading.Event()
        self.faults: list[Fault] = []
        self.errors: list[str] = []
        self._deck: list[str] = []
        self._current: Fault | None = None

    def run(self) -> None:
        while not self.halt.wait(self.rng.uniform(0.75, 1.25) * self.every_s):
            if not self._deck:
                self._deck = list(self.kinds)
                self.rng.shuffle(self._deck)
            try:
                self.inject(self._deck.pop())
            except Exception as exc:  # a bug of the harness: reported, the run goes on
                self.errors.append(f"{type(exc).__name__}: {exc}")

    # -- actions ------------------------------------------------------------------------

    def _note(self, text: str) -> None:
        fault = self._current
        assert fault is not None
        fault.actions.append(f"+{time.time() - fault.at:.2f}s {text}")

    def _signal(self, rank: int, sig: signal.Signals) -> bool:
        pid = self.host.signal(rank, sig)
        if pid is None:
            assert self._current is not None
            self._current.missed.append(f"r{rank} {sig.name}: no daemon running")
            self._note(f"r{rank} {sig.name} missed (no daemon running)")
            return False
        self._note(f"r{rank} {sig.name} pid {pid}")
        return True

    def _wait(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))  # the fault itself: a process stays stopped this long

    def _stop_for(self, rank: int, seconds: float) -> Callable[[], None]:
        """SIGSTOP now: -> what sends SIGCONT (to the same process)."""
        pid = self.host.pid(rank)
        if pid is None or not self._signal(rank, signal.SIGSTOP):
            return _nothing
        self._note(f"r{rank} stopped for {seconds:.2f}s")

        def resume() -> None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
            self._note(f"r{rank} SIGCONT pid {pid}")

        return resume

    def _pause(self, rank: int, seconds: float) -> None:
        where = self.rng.choice(("before_send", "after_send"))
        self.pause_scheduler(rank, where, seconds)
        self._note(f"r{rank} scheduler paused {where} for {seconds:.2f}s")

    def _stop_s(self) -> float:
        return self.rng.uniform(0.5, 2.0) * self.agreement_s

    def _pause_s(self) -> float:
        return self.rng.uniform(0.5, 1.3) * self.call_timeout_s

    # -- one fault ------------------------------------------------------------------------

    def inject(self, kind: str) -> Fault:
        rng = self.rng
        first, second = rng.sample(range(self.ranks), 2)
        ranks = [first, second] if kind in COMBINED and kind not in ("kill_then_round_exit",
                                                                      "kill_then_attach_exit") else [first]
        seen = {r: open_labels(what_is_open(self.host.sockets[r], timeout_s=0.5)) for r in ranks}
        fault = Fault(len(self.faults) + 1, kind, ranks, time.time(), self.iteration(), seen)
        self.faults.append(fault)
        self._current = fault
        try:
            self._inject(kind, first, second)
        finally:
            fault.ended = time.time()
            self._current = None
        return fault

    def _inject(self, kind: str, a: int, b: int) -> None:
        rng = self.rng
        fault = self._current
        assert fault is not None
        if kind == "daemon_sigkill":
            self._signal(a, signal.SIGKILL)
        elif kind == "daemon_sigterm":
            self._signal(a, signal.SIGTERM)
        elif kind == "daemon_sigstop":
            resume = self._stop_for(a, seconds := self._stop_s())
            self._wait(seconds)
            resume()
        elif kind == "scheduler_pause":
            self._pause(a, self._pause_s())
        elif kind == "flood":
            hold = rng.uniform(1.0, 3.0) * self.agreement_s
            self._note(f"r{a} flood: {self.flood_streams} idle Steps streams, {self.flood_calls} Status callers "
                       f"for {hold:.2f}s")
            fault.flood = self.host.flood(a, self.flood_streams, self.flood_calls, hold)
        elif kind == "two_daemons":
            how = [rng.choice(("sigkill", "sigterm", "sigstop")) for _ in (a, b)]
            resumes, seconds = [], self._stop_s()
            for rank, what in zip((a, b), how):
                if what == "sigstop":
                    resumes.append(self._stop_for(rank, seconds))
                else:
                    self._signal(rank, signal.SIGKILL if what == "sigkill" else signal.SIGTERM)
            if resumes:
                self._wait(seconds)
                for resume in resumes:
                    resume()
        elif kind == "kill_while_stopped":
            if rng.random() < 0.5:
                resume = self._stop_for(a, seconds := self._stop_s())
            else:
                self._pause(a, seconds := self._pause_s())
                resume = _nothing
            before = rng.uniform(0.1, 0.8) * min(seconds, self.agreement_s)
            self._wait(before)
            self._signal(b, signal.SIGKILL)
            self._wait(seconds - before)
            resume()
        elif kind == "term_during_reform":
            self._signal(a, signal.SIGKILL)
            self._wait(rng.uniform(0.0, 1.5) * self.agreement_s)
            self._signal(b, signal.SIGTERM)
        elif kind == "kill_mid_drain":
            self._signal(a, signal.SIGTERM)
            self._wait(rng.uniform(0.05, 1.0) * (self.agreement_s + 1.0))  # the drain: agreement_timeout_s + 1
            self._signal(a if rng.random() < 0.5 else b, signal.SIGKILL)
        elif kind == "kill_then_round_exit":
            step = rng.randint(1, 3)
            self.host.arm(a, {"fault_exit_after_round": step})
            self._note(f"r{a} next daemon armed: dies after the round of step {step}, before its reply")
            self._signal(a, signal.SIGKILL)
        elif kind == "kill_two_then_round_exit":
            step = rng.randint(1, 3)
            for rank in (a, b):
                self.host.arm(rank, {"fault_exit_after_round": step})
            self._note(f"r{a} r{b} next daemons armed: both die after the round of step {step}, before their replies")
            self._signal(a, signal.SIGKILL)
            self._signal(b, signal.SIGKILL)
        elif kind == "kill_then_attach_exit":
            self.host.arm(a, {"fault_exit_after_attach": 1})
            self._note(f"r{a} next daemon armed: dies once its first Attach is agreed, before its reply")
            self._signal(a, signal.SIGKILL)
        else:
            raise ValueError(f"unknown fault kind {kind!r}")
