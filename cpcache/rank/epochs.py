"""A rank's domain across epochs (docs/design.md rule 10): formed once every rank
has joined, formed again in the next epoch when a peer is lost, a rank
restarts or an Attach's confirmation timed out, with what the host pool
holds carried over to the scheduler's next attach.

A rank's standing, while its daemon serves:

    FORMING -> SERVING -> REFORMING -> SERVING (in a later epoch) -> ...
               SERVING -> BROKEN (the engine failed other than by a lost peer)
               BROKEN -> REFORMING (an Attach's confirmation timed out meanwhile)

Decisions are taken only while SERVING. Epoch numbers only grow
(`agreement.epochs`); each epoch has its own engine, stepper and Attach
confirmation group, and nothing of an ended epoch applies after it ended.
Touched from the event loop, except the blocking formation (on a thread of
its own) and the epoch watch (a daemon thread that only posts to the loop).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import datetime
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from torch.distributed import TCPStore

from cpcache.agreement.bounded import bounded_async
from cpcache.agreement.collective import Reducer, Rendezvous, build_reducer, confirmation_reducer, host_store
from cpcache.agreement.engine import AgreementEngine, DivergenceExchange, Recovered, RoundFaults
from cpcache.agreement.epochs import Epochs
from cpcache.agreement.liveness import Heartbeat
from cpcache.agreement.witness import RoundWitness
from cpcache.config import DaemonConfig
from cpcache.errors import CacheError, PeerLost, Unavailable
from cpcache.rank.assembly import CacheRuntime, carry_over
from cpcache.rank.cache_closing import close_storage, finish_copies
from cpcache.rank.diagnosis import diagnose_round
from cpcache.rank.standing import RankHost, Standing
from cpcache.rank.stepper import StepAnswer, Stepper
from cpcache.state import carryover
from cpcache.values import split_host_port

log = logging.getLogger("cpcached")

EPOCHS_KEPT = 4  # ended epochs whose step outcomes are still answered
JOIN_MIN_S = 10.0  # the least a gloo group's join waits once every rank of the epoch is there


def _exit_after_round(dying_step: int, step: int) -> None:
    """Fault injection: die between a round and its step's answer."""
    if step == dying_step:
        log.error("fault injection: exiting after the round of step %d, before answering it", step)
        os._exit(137)


class Formed(NamedTuple):
    """An epoch just formed: its rounds' reducer, its Attach confirmations'
    reducer, and what every rank offered to carry over."""

    reducer: Reducer
    confirmer: Reducer
    offers: list[bytes]
    diagnosis_store: TCPStore | None  # opened now: a diagnosis must not need a new connection


@dataclass(frozen=True)
class Held:
    """A cache and what it was attached with (the Attach descriptor)."""

    runtime: CacheRuntime
    descriptor: dict[str, Any]


class Formation:
    def __init__(self, config: DaemonConfig, host: RankHost) -> None:
        self.config = config
        self._host = host
        self.domain = config.topology.domain(config.rank)
        self._epochs = Epochs(Rendezvous(
            *split_host_port(config.rendezvous), config.deployment, config.epoch, config.rendezvous_timeout_s
        ), tuple(self.domain.ranks))
        self.rdzv = self._epochs.base  # the current epoch's; replaced when the domain re-forms
        self.standing = Standing.FORMING
        self.engine: AgreementEngine | None = None
        self.stepper: Stepper | None = None
        # The steppers of the last few epochs, the current one's included: a
        # step's outcome is answered from its epoch's even after it ended
        # (a retry, or a peer's scheduler whose daemon died: `Rank.outcome`).
        self.recent: collections.OrderedDict[int, Stepper] = collections.OrderedDict()
        self.confirmer: Reducer | None = None  # this epoch's group for Attach confirmations
        self.busy: list[int] = []  # host slots this epoch started with retired (agreed)
        # The cache of an ended session or epoch, detached from its device pool,
        # until an Attach of the same model and geometry picks it up again.
        self.kept: Held | None = None
        self._detaching: CacheRuntime | None = None  # a cache whose session is ending: its copies are finished
        self.attached_with: dict[str, Any] | None = None  # the descriptor of the attached cache
        self.attaching: asyncio.Future | None = None  # an Attach being decided: re-forming waits for it
        self._reforming: asyncio.Future[None] | None = None
        self._reform_reason = ""
        self._heartbeat: Heartbeat | None = None
        self._store_server: TCPStore | None = None  # when this daemon hosts the rendezvous store
        # Each stepper's `recorded`: the daemon records step outcomes where
        # its scheduler reads them after the daemon's death (step_outcomes.py).
        self.record_outcome: Callable[[int, int, StepAnswer | CacheError], None] | None = None

    @property
    def epoch(self) -> int:
        return self.rdzv.epoch

    # -- what an Attach changes (rank/attach.py decides it; the fields are this class's)

    def attach_started(self, task: asyncio.Future) -> None:
        """An Attach is being decided: re-forming waits for it."""
        self.attaching = task

    def kept_for(self, descriptor: dict[str, Any]) -> Held | None:
        """The cache kept apart, if it was attached with `descriptor`."""
        return self.kept if self.kept is not None and self.kept.descriptor == descriptor else None

    def release_kept(self) -> Held | None:
        """Give up the cache kept apart (another model or geometry was
        agreed): -> it, whose storage its caller closes."""
        released, self.kept = self.kept, None
        return released

    def session_started(self, stepper: Stepper, runtime: CacheRuntime, descriptor: dict[str, Any]) -> None:
        """An agreed Attach: `stepper` decides over `runtime`, attached with
        `descriptor`; nothing is kept apart any more."""
        stepper.runtime = runtime
        self.kept, self.attached_with = None, descriptor

    def admit(self) -> Stepper:
        """The stepper that decides now, or why decisions are refused."""
        why = self._host.not_serving()
        if why is not None:
            raise Unavailable(f"rank {self.config.rank} is {why}, not serving decisions")
        if self.standing is Standing.SERVING and self.stepper is not None:
            return self.stepper
        if self.standing is Standing.REFORMING:
            raise Unavailable(f"rank {self.config.rank} is re-forming its domain out of epoch {self.epoch} "
                              f"({self._reform_reason}); decisions resume once every rank has joined")
        if self.standing is Standing.BROKEN and self.engine is not None and self.engine.failure is not None:
            raise self.engine.failure
        raise Unavailable(f"rank {self.config.rank} is {self.standing.value}, not serving decisions")

    def _serving(self) -> bool:
        return self.standing is Standing.SERVING and self._host.not_serving() is None

    # -- forming --------------------------------------------------------------

    def join(self) -> Formed:
        """Blocking rendezvous, on a thread of its own: the deployment's
        current epoch, or the next one when the current one formed without
        this rank (it restarted)."""
        if self.config.host_store:
            host, port = split_host_port(self.config.rendezvous)
            self._store_server = host_store(host, port)
        store = self._epochs.base.connect()
        return self._form(store, self._epochs.to_join(store, self.config.epoch), b"")

    def _rejoin(self, leaving: int, offer: bytes) -> Formed:
        store = self._epochs.base.connect()
        return self._form(store, self._epochs.advance(store, leaving), offer)

    def _form(self, store: TCPStore, epoch: int, offer: bytes) -> Formed:
        """Join `epoch` with every rank of the domain, then trade what each
        carries over (blocking)."""
        config = self.config
        self.rdzv = self._epochs.rendezvous(epoch)
        if self._heartbeat is not None:
            self._heartbeat.stop()
        self._heartbeat = Heartbeat(self.rdzv, config.rank, config.heartbeat_interval_s,
                                    RoundWitness(self.rdzv, config.rank, tuple(self.domain.ranks)))
        self._heartbeat.start()
        # Every rank is there before the groups are joined, and a join then
        # waits only as long as connecting takes: a peer that died in
        # between costs a short wait and the next epoch, not the whole
        # rendezvous timeout while the others have moved on.
        self._epochs.gather(store, epoch, config.rank, tuple(self.domain.ranks), config.rendezvous_timeout_s)
        join_s = min(config.rendezvous_timeout_s, max(JOIN_MIN_S, 3 * config.agreement_timeout_s))
        joining = dataclasses.replace(self.rdzv, timeout_s=join_s)
        store.set_timeout(datetime.timedelta(seconds=join_s))  # the peers' addresses are read within it too
        reducer = build_reducer(store, joining, config.topology, config.rank, config.mode,
                                config.agreement_timeout_s, config.gloo_host)
        confirmer: Reducer | None = None
        try:
            confirmer = confirmation_reducer(store, joining, self.domain, config.rank,
                                             config.agreement_timeout_s, config.gloo_host)
            offers = self._epochs.exchange(store, epoch, config.rank, tuple(self.domain.ranks), offer,
                                           config.rendezvous_timeout_s)
            self._epochs.mark_formed(store, epoch)
        except BaseException:
            reducer.close()
            if confirmer is not None:
                confirmer.close()
            raise
        diagnosis_store = None
        with contextlib.suppress(RuntimeError):  # without it, a diagnosis connects when it needs to
            diagnosis_store = self.rdzv.connect()
        return Formed(reducer, confirmer, offers, diagnosis_store)

    async def serve(self, formed: Formed, note: str = "") -> None:
        """Decide in the epoch just formed: a new engine and stepper, and the
        carried-over cache (the pages every rank offered alike), if any.
        `note`: the status line to show the service manager, if any."""
        config, loop = self.config, asyncio.get_running_loop()
        self.confirmer = formed.confirmer
        witness = self._heartbeat.witness if self._heartbeat is not None else None
        engine = AgreementEngine(
            formed.reducer,
            DivergenceExchange(self.rdzv.connect(), self.rdzv.namespace, config.rank, self.domain.ranks,
                               config.agreement_timeout_s),
            functools.partial(self._diagnose, formed.diagnosis_store, witness),
            heartbeat=self._heartbeat,
            faults=RoundFaults(config.faults.delay_ms, config.faults.seed + config.rank,
                               config.faults.round_lost_after_complete),
            on_failure=lambda failure: loop.call_soon_threadsafe(self._on_failure, failure, engine),
            witness=witness,
        )
        self.engine = engine
        self.stepper = Stepper(engine, config.rank, config.agreement_lag, self.epoch)
        self.recent[self.epoch] = self.stepper
        self.stepper.recorded = self.record_outcome
        if config.faults.exit_after_round:
            self.stepper.after_round = functools.partial(_exit_after_round, config.faults.exit_after_round)
        while len(self.recent) > EPOCHS_KEPT:
            self.recent.popitem(last=False)
        decoded = [carryover.decode(offer) for offer in formed.offers]
        kept = carryover.common([o.pages for o in decoded])
        # Every rank's cache of this epoch starts with these slots retired,
        # kept or new alike, so all of them allocate the same slots.
        busy = self.busy = carryover.busy_slots(decoded, kept)
        if self.kept is not None:
            runtime = carry_over(self.kept.runtime, kept, busy, config.storage_timeout_s)
            self.kept = Held(runtime, self.kept.descriptor)
            log.info("epoch %d carries %d host pages over (until the scheduler attaches again); %d slots wait "
                     "for I/O to end", self.epoch, len(kept), len(busy))
        self.standing = Standing.SERVING
        await self._host.standing_changed(Standing.SERVING, note)

    # -- re-forming -----------------------------------------------------------

    def reform_soon(self, reason: str) -> None:
        self._host.spawn(self.reform(reason), "re-form")

    async def reform(self, reason: str) -> None:
        """Form the domain again in the next epoch (once, however many ask)."""
        if self._reforming is None or self._reforming.done():
            self._reforming = asyncio.ensure_future(self._reform(reason))
        await asyncio.shield(self._reforming)

    async def wait_reformed(self) -> None:
        if self.standing is Standing.REFORMING and self._reforming is not None:
            await asyncio.shield(self._reforming)

    async def _reform(self, reason: str) -> None:
        if self.standing not in (Standing.SERVING, Standing.BROKEN) or self._host.not_serving() is not None:
            return
        leaving = self.epoch
        self.standing, self._reform_reason = Standing.REFORMING, reason
        log.warning("leaving epoch %d: %s", leaving, reason)
        await self._host.standing_changed(Standing.REFORMING, f"re-forming out of epoch {leaving}: {reason}")
        attaching = self.attaching
        if attaching is not None and not attaching.done():
            # An Attach being decided is answered from its one decision on
            # every rank (never refused here after its peers were told
            # "attached"); the session it opens then ends with this epoch.
            await asyncio.wait({attaching})
        engine, stepper = self.engine, self.stepper
        self.engine = self.stepper = None  # no step reaches them from here
        if engine is not None:
            # Really joined: a round still in its collective ends within the
            # collective's own timeout; rounds not begun fail.
            await bounded_async(functools.partial(engine.close, None, f"epoch {leaving} was left"), None,
                                "close-epoch")
        if stepper is not None:
            # A round that completed is agreed: a peer that completed it
            # applies it, so this rank does too (and answers its step alike),
            # before its I/O drains below; then nothing more applies.
            await stepper.finish_in_flight()
            stepper.leave(f"rank {self.config.rank} left epoch {leaving} ({reason})")
        confirmer, self.confirmer = self.confirmer, None
        if confirmer is not None:  # no Attach is being decided (awaited above)
            await bounded_async(confirmer.close, None, "close-confirm")
        offer = await self._detach(stepper)
        if stepper is not None:
            # Kept in `recent` for its outcomes only: not the cache (its session's pool and board).
            stepper.runtime = None
        stop = self._host.stop_requested
        while not stop.is_set():
            forming = asyncio.ensure_future(bounded_async(functools.partial(self._rejoin, leaving, offer), None,
                                                          "re-form"))
            stopping = asyncio.ensure_future(stop.wait())
            await asyncio.wait((forming, stopping), return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if not forming.done():
                forming.cancel()
                return  # stopping: the shutdown follows
            try:
                formed = forming.result()
            except (RuntimeError, CacheError) as exc:
                log.warning("epoch %d did not form (%s); trying the next", self.epoch, exc)
                leaving = self.epoch
                continue
            log.info("serving rank %d in epoch %d", self.config.rank, self.rdzv.epoch)
            await self.serve(formed, f"serving rank {self.config.rank} in epoch {self.rdzv.epoch}")
            return

    async def _detach(self, stepper: Stepper | None) -> bytes:
        """Keep the cache of the ending epoch for the scheduler's next attach,
        once this rank's I/O has drained (docs/design.md rule 5); what it may offer."""
        held: Held | None = None
        if stepper is not None and stepper.runtime is not None and self.attached_with is not None:
            held = Held(stepper.runtime, self.attached_with)
        elif stepper is None or stepper.runtime is None:
            held = self.kept
        if held is None:
            return b""
        runtime = self._detaching = held.runtime
        # The session ends: its storage jobs not yet started are refused from
        # now on, its copies run to their end (a forward may be reading a
        # load: docs/design.md rule 12), and its pool is let go only once none of its
        # jobs touches it (counted: a copy between memory pools ends).
        session = runtime.io.end_session()
        try:
            await bounded_async(session.wait_device_quiet, None, "device-quiet")
            drain_s = 2 * self.config.storage_timeout_s + 5.0
            idle = await asyncio.to_thread(runtime.io.wait_idle, drain_s)
        finally:
            self._detaching = None
        self.kept, self.attached_with = held, None
        if not idle:
            busy = runtime.io.busy_slots()
            log.warning("I/O still in flight after %.0fs on %d slots: this rank carries no pages over, and "
                        "those slots stay out of use until it ends", drain_s, len(busy))
            return carryover.encode([], busy)
        return carryover.encode(carryover.offer(runtime.state.ledger.index))

    # -- watching -------------------------------------------------------------

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        threading.Thread(target=self._watch, args=(loop,), name="epoch-watch", daemon=True).start()

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """On a daemon thread: notice the deployment moving to a later epoch
        (a restarted rank started one), and leave this one."""
        store: TCPStore | None = None
        stopped = threading.Event()
        interval = max(0.2, 2 * self.config.heartbeat_interval_s)
        while not stopped.wait(interval):
            if self._host.stop_requested.is_set():
                return
            try:
                store = store or self._epochs.base.connect(timeout_s=max(1.0, 5 * interval))
                current = self._epochs.current(store)
                serving = self.epoch
                if current < serving and self._serving() and self._epochs.restore(store, serving):
                    log.warning("the rendezvous store read epoch %d below this domain's %d (it restarted); "
                                "wrote %d back so that epochs only grow", current, serving, serving)
            except Exception:  # the store is away (or answered nonsense): the rounds will say what that means
                store = None
                continue
            if current > self.epoch and self._serving():
                with contextlib.suppress(RuntimeError):  # the loop is closed: the daemon has stopped
                    loop.call_soon_threadsafe(self._epoch_moved, current)

    def _epoch_moved(self, current: int) -> None:
        if self._serving() and current > self.epoch:
            self.reform_soon(f"the deployment moved to epoch {current}")

    def _diagnose(self, store: TCPStore | None, witness: RoundWitness | None, round_number: int,
                  exc: BaseException) -> PeerLost | Recovered:
        """On the agreement thread: what round `round_number` failing here
        means, in the current epoch (`diagnosis.diagnose_round`)."""
        return diagnose_round(self.rdzv, self.config, self.domain.ranks, store, witness, round_number, exc)

    def _on_failure(self, failure: CacheError, engine: AgreementEngine) -> None:
        if engine is not self.engine or not self._serving():
            return  # an epoch already left, or the daemon stops
        if isinstance(failure, PeerLost):
            self.reform_soon(str(failure))
            return
        self.standing = Standing.BROKEN
        self._host.spawn(self._host.standing_changed(Standing.BROKEN, f"broken: {failure}"), "health")

    # -- closing --------------------------------------------------------------

    async def settle_steps(self, timeout_s: float) -> None:
        """The daemon stops, and still answers: no round begins any more (a
        step taken whose round has not begun fails here, and on its peers,
        which wait in that round for this rank: UNAVAILABLE everywhere), and
        the steps already taken end (for up to `timeout_s`): the round in its
        collective completes or fails within agreement_timeout_s, and is
        answered as on every peer, while the daemon's server still runs. A
        server stopped sooner could leave a scheduler told "not taken" by a
        peer that then completes the round with this rank (docs/design.md
        rule 12). Called before the server stops; `close` follows."""
        stepper, engine = self.stepper, self.engine
        if engine is not None:
            await asyncio.to_thread(engine.close, 0.0)  # joins nothing: the round in progress runs on
        if stepper is None or not stepper.deciding:
            return
        log.info("waiting for the steps taken (up to step %d) to be decided and answered before the server "
                 "stops, for up to %.1fs", stepper.last_step, max(0.0, timeout_s))
        try:
            await asyncio.wait_for(asyncio.shield(stepper.finish_in_flight()), max(0.0, timeout_s))
        except TimeoutError:
            log.warning("the steps taken were still being decided after %.1fs; stopping anyway", timeout_s)

    async def close(self, copies_s: float = 0.0) -> None:
        """Close the epoch's groups, let the copies every cache has issued
        end (for up to `copies_s`: a forward may be reading a load,
        docs/design.md rule 12), then close every cache's storage (the daemon
        stops: no call reaches the rank any more)."""
        if self.engine is not None:
            await asyncio.to_thread(self.engine.close)
        if self.confirmer is not None:
            await asyncio.to_thread(self.confirmer.close)
        runtimes: dict[int, CacheRuntime] = {}  # one per set of movers
        for runtime in (self.stepper.runtime if self.stepper is not None else None,
                        self._detaching, self.kept.runtime if self.kept is not None else None):
            if runtime is not None:
                runtimes.setdefault(id(runtime.io.transfers), runtime)
        deadline = time.monotonic() + copies_s
        for runtime in runtimes.values():
            await finish_copies(runtime, deadline - time.monotonic())
        for runtime in runtimes.values():
            await close_storage(runtime, "closing the storage backend")
        if self._heartbeat is not None:
            self._heartbeat.stop()
        self._store_server = None
