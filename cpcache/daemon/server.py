"""The daemon's lifecycle: start, rendezvous, serve, drain, stop.

States move one way: STARTING -> JOINING -> SERVING -> DRAINING -> STOPPED,
with BROKEN beside SERVING once the domain has lost a peer (decisions are
then refused with UNAVAILABLE; health is NOT_SERVING). Signal handlers only
set an event; a second signal forces exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import functools
import logging
import os
import signal
import threading
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar

import grpc
from google.protobuf import message_factory
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from torch.distributed import TCPStore

from cpcache.agreement.attach import Unconfirmed, agree_on_attach
from cpcache.agreement.collective import Reducer, Rendezvous, build_reducer, confirmation_reducer, host_store
from cpcache.agreement.engine import AgreementEngine, DivergenceExchange, FaultInjection, peer_lost
from cpcache.agreement.epochs import Epochs
from cpcache.agreement.liveness import Heartbeat, diagnose
from cpcache.config import DaemonConfig
from cpcache.daemon import budget, metrics
from cpcache.daemon.listeners import release_unix, start_listeners
from cpcache.daemon.metrics import DaemonCollector, phase_counters
from cpcache.daemon.pool_handover import SUFFIX as POOLS_SUFFIX
from cpcache.daemon.pool_handover import PoolHandover
from cpcache.daemon.servicer import CacheDaemonServicer
from cpcache.daemon.status import tolerant
from cpcache.daemon.systemd import Notifier, extend_timeout_while
from cpcache.daemon.wire import Attached, DaemonStatus
from cpcache.dataplane.pools import DevicePool
from cpcache.dataplane.sessions import Session
from cpcache.errors import CacheError, FailedPrecondition, PeerLost, Unavailable
from cpcache.geometry import KVGeometry
from cpcache.keys import namespace_seed
from cpcache.rank.assembly import CacheRuntime, carry_over, check_host_budget, open_cache
from cpcache.rank.stepper import Stepper
from cpcache.state import carryover
from cpcache.topology import Topology
from cpcache.v1 import daemon_pb2 as pb
from cpcache.values import MAX_MESSAGE_BYTES, split_host_port

log = logging.getLogger("cpcached")

T = TypeVar("T")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["CacheDaemon"].full_name


class State(enum.Enum):
    STARTING = "starting"
    JOINING = "joining"  # rendezvous with the peers
    SERVING = "serving"
    REFORMING = "reforming"  # a rank was lost: the domain forms again in the next epoch
    BROKEN = "broken"  # a peer was lost: decisions are refused
    DRAINING = "draining"
    STOPPED = "stopped"


class _Formed(NamedTuple):
    """An epoch just formed: its rounds' reducer, its Attach confirmations'
    reducer, and what every rank offered to carry over."""

    reducer: Reducer
    confirmer: Reducer
    offers: list[bytes]
    diagnosis_store: TCPStore | None  # opened now: a diagnosis must not need a new connection


@dataclasses.dataclass(frozen=True)
class _LastAttach:
    """The attach that began the current session, to answer its retries."""

    stepper: Stepper
    descriptor: dict[str, Any]
    pool: tuple[int, ...]
    step: int
    attached: Attached


class ExitCode(enum.IntEnum):
    STOPPED = 0  # stopped on request, cleanly
    INTERNAL = 1  # a background task crashed: the daemon drained and stopped
    CONFIG = 2  # settings were invalid
    RENDEZVOUS_FAILED = 3  # peers did not join in time
    PEER_LOST = 4  # stopped on request after the domain had lost a peer
    FORCED = 130  # a second signal cut the drain short


class Daemon:
    def __init__(self, config: DaemonConfig, notify_socket: str | None = None, watchdog_usec: int = 0) -> None:
        """`notify_socket` and `watchdog_usec` come from systemd's environment
        (NOTIFY_SOCKET, WATCHDOG_USEC), read by the entry point."""
        self.config = config
        self.notifier = Notifier(notify_socket)
        self._watchdog_s = watchdog_usec / 2e6 if watchdog_usec else 0.0
        self.metrics = DaemonCollector(self)
        self.metrics_port = 0
        self.state = State.STARTING
        self._topology = config.topology
        self._domain = self._topology.domain(config.rank)
        self._epochs = Epochs(Rendezvous(
            *split_host_port(config.rendezvous), config.deployment, config.epoch, config.rendezvous_timeout_s
        ), tuple(self._domain.ranks))
        self._rdzv = self._epochs.base  # the current epoch's; replaced when the domain re-forms
        self._reforming: asyncio.Future[None] | None = None
        self._reform_reason = ""
        # The cache of an ended session or epoch, detached from its device pool,
        # until an Attach of the same model and geometry picks it up again.
        self._kept: tuple[CacheRuntime, dict[str, Any]] | None = None
        self._descriptor: dict[str, Any] | None = None  # what the attached cache was attached with
        self._pools: PoolHandover | None = None
        self._attach_task: asyncio.Future[Attached] | None = None
        self._epoch_busy: list[int] = []  # host slots this epoch started with retired (agreed)
        self._last_attach: _LastAttach | None = None
        self.reforms = 0
        self._health = health_async.HealthServicer()
        self._servers: list[grpc.aio.Server] = []
        self._stop_requested = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._in_flight = 0
        self._signals = 0
        self._store_server: TCPStore | None = None  # when this daemon hosts the rendezvous store
        self._heartbeat: Heartbeat | None = None
        self._engine: AgreementEngine | None = None
        self._coordinator: Stepper | None = None
        self._background: set[asyncio.Task] = set()
        self._attach_joined = (-1, 0)  # (epoch, attempt) of the last attach agreement this rank joined
        self._confirmer: Reducer | None = None  # this epoch's group for Attach confirmations
        self._sessions = 0  # data-plane sessions opened
        self._crashed = False  # a background task died: exit INTERNAL after the drain

    # -- what the servicer and the metrics see -----------------------------

    @property
    def engine(self) -> AgreementEngine | None:
        return self._engine

    @property
    def coordinator(self) -> Stepper | None:
        return self._coordinator

    @property
    def epoch(self) -> int:
        return self._rdzv.epoch

    def admit_decision(self) -> Stepper:
        if self.state is State.SERVING and self._coordinator is not None:
            return self._coordinator
        if self.state is State.REFORMING:
            raise Unavailable(f"rank {self.config.rank} is re-forming its domain out of epoch {self.epoch} "
                              f"({self._reform_reason}); decisions resume once every rank has joined")
        if self.state is State.BROKEN and self._engine is not None and self._engine.failure is not None:
            raise self._engine.failure
        raise Unavailable(f"rank {self.config.rank} is {self.state.value}, not serving decisions")

    @contextlib.contextmanager
    def in_flight(self) -> Iterator[None]:
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    def cache_runtime(self) -> CacheRuntime:
        coordinator = self.admit_decision()
        if coordinator.cache is None:
            raise FailedPrecondition("no device pool is attached: call Attach first")
        return coordinator.cache

    async def attach(self, model_id: str, geometry: KVGeometry, device_pages: int, kind: str,
                     pool: str | pb.CudaIpcHandle) -> Attached:
        """Open the pool and the cache here, then agree with every rank of the
        domain that all of them attached the same thing; only then is the
        cache used. The outcome belongs to the daemon: a cancelled call does
        not undo it."""
        task = asyncio.ensure_future(self._attach(model_id, geometry, device_pages, kind, pool))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return await asyncio.shield(task)

    async def _attach(self, model_id: str, geometry: KVGeometry, device_pages: int, kind: str,
                      pool: str | pb.CudaIpcHandle) -> Attached:
        if self.state is State.REFORMING and self._reforming is not None:
            await asyncio.shield(self._reforming)
        self.admit_decision()
        while self._attach_task is not None and not self._attach_task.done():
            # One at a time: a retry of a cancelled call waits for that call's attach.
            await asyncio.wait({self._attach_task})
        # The pool is opened and checked before anything else changes: a bad
        # one is refused without ending the session that works.
        check_host_budget(self.config, geometry)
        device = await asyncio.to_thread(self._open_device, geometry, device_pages, pool)
        descriptor = self._attach_descriptor(model_id, geometry, device_pages)
        stepper = self.admit_decision()
        last = self._last_attach
        if (stepper.cache is not None and last is not None and last.stepper is stepper
                and last.descriptor == descriptor and last.pool == device.identity and stepper.last_step == last.step):
            return last.attached  # a retry of the attach that began this session: the same answer
        if stepper.cache is not None:
            # A scheduler attached again (it restarted): its old session ends
            # on every rank the same way, by forming the domain again; what
            # the host pool holds is carried over.
            await self.reform("a scheduler attached again: its previous session ends")
            stepper = self.admit_decision()
        task = asyncio.ensure_future(self._attach_agreed(stepper, model_id, geometry, device, descriptor, kind))
        self._attach_task = task
        return await task

    async def _attach_agreed(self, stepper: Stepper, model_id: str, geometry: KVGeometry, device: DevicePool,
                             descriptor: dict[str, Any], kind: str) -> Attached:
        runtime: CacheRuntime | None = None
        kept = self._kept if self._kept is not None and self._kept[1] == descriptor else None
        # What the attach resumes is part of what every rank must agree on.
        resumes = carryover.digest(kept[0].state.index) if kept is not None and len(kept[0].state.index) else 0
        confirmer = self._confirmer
        try:
            runtime = await asyncio.to_thread(self._open_cache, model_id, geometry, device,
                                              kept[0] if kept else None)
            if kept is None:
                runtime.state.carried_over([], self._epoch_busy)
            # From here the domain decides, once, for every rank alike: nothing
            # local may refuse after this point (refusals come before, above).
            # Domains of one deployment (attention-DP replicas) attach apart.
            namespace = f"{self._rdzv.namespace}/domain{'-'.join(map(str, self._domain.ranks))}"
            epoch, joined = self._attach_joined
            assert confirmer is not None
            rdzv, this_epoch = self._rdzv, self.epoch
            store_timeout_s = max(1.0, min(5.0, self.config.agreement_timeout_s / 4))

            def joining(attempt: int) -> None:
                self._attach_joined = (this_epoch, attempt)

            try:
                await asyncio.to_thread(agree_on_attach, lambda: rdzv.connect(timeout_s=store_timeout_s), namespace,
                                        self.config.rank, self._domain.ranks, {**descriptor, "resumes": resumes},
                                        joined if epoch == this_epoch else 0, self.config.agreement_timeout_s,
                                        confirmer, on_attempt=joining)
            except Unconfirmed:
                # The confirmation's collective timed out: its group is unusable.
                self._spawn(self.reform("an Attach was not confirmed by every rank"), "re-form")
                raise
            if self._coordinator is not stepper:
                # The epoch ended while it was decided: it ended for every rank,
                # and with it the session every rank attached in it.
                raise Unavailable("the domain formed again while this Attach was agreed; attach again")
        except BaseException:
            if runtime is not None and kept is None:
                runtime.io.transfers.close()
            raise  # a kept runtime stays kept, for the next attempt: no session was opened on it
        if kept is None and self._kept is not None:  # another model or geometry, agreed: start clean
            old, self._kept = self._kept[0], None
            # Decided: nothing may fail here any more (a storage that fails to
            # close is logged, not answered), or ranks would end apart.
            await _bounded(old.io.transfers.close, 5.0, "closing the previous cache's storage")
        # The session's jobs bind this pool when they are issued; the previous
        # session of this runtime ended (and its device jobs with it) on detach.
        self._sessions += 1
        runtime.io.session = Session(self.epoch, self._sessions, device)
        stepper.cache = runtime
        self._kept, self._descriptor = None, descriptor
        resumed = len(runtime.state.index) if kept is not None else 0
        self._key_seed = namespace_seed(model_id, geometry.dtype, self.config.host_layout, geometry.page_size)
        log.info("attached %r in epoch %d: %d device pages of %d bytes (%s), %d host pages resumed", model_id,
                 self.epoch, device.pages, geometry.page_bytes, kind, resumed)
        storage = runtime.io.transfers.tiers.storage
        attached = Attached(geometry.page_bytes, self.config.host_pool_pages, self.config.host_layout,
                            storage.name if storage else "none", self._key_seed, resumed)
        self._last_attach = _LastAttach(stepper, descriptor, device.identity, stepper.last_step, attached)
        return attached

    def _open_device(self, geometry: KVGeometry, device_pages: int, pool: str | pb.CudaIpcHandle) -> DevicePool:
        if isinstance(pool, str):
            if self._pools is None:
                raise Unavailable("attach: the pool handover socket is not open yet")
            fd, uid, pid = self._pools.take(pool)
            device = DevicePool.from_fd(fd, geometry, device_pages)
            log.info("attach: pool of %d pages handed over by pid %d (uid %d)", device_pages, pid, uid)
            return device
        handle = {f.name: getattr(pool, f.name) for f in pool.DESCRIPTOR.fields}
        return DevicePool.from_cuda_ipc(handle, geometry, device_pages)

    def _open_cache(self, model_id: str, geometry: KVGeometry, device: DevicePool,
                    kept: CacheRuntime | None = None) -> CacheRuntime:
        check_host_budget(self.config, geometry)
        if kept is not None:  # the same model and geometry: the host pool and its pages go on
            return kept
        return open_cache(self.config, geometry, device, model_id)

    def _attach_descriptor(self, model_id: str, geometry: KVGeometry, device_pages: int) -> dict[str, Any]:
        """What must be the same on every rank: it shapes the shared state."""
        return {"model_id": model_id, "geometry": dataclasses.asdict(geometry), "device_pages": device_pages,
                "host_pool_pages": self.config.host_pool_pages, "host_layout": self.config.host_layout,
                "cache": dataclasses.asdict(self.config.cache_config)}

    def stats(self) -> dict[str, int]:
        counters = {"rounds_completed": self._engine.rounds_completed if self._engine else 0}
        if self._pools is not None:  # what the handover refused (docs/security.md, "Resource budget")
            counters.update(self._pools.stats())
        coordinator = self._coordinator
        if coordinator is not None:
            counters["last_step"] = coordinator.last_step
            counters["decisions"] = coordinator.decision_count
            if coordinator.cache is not None:
                counters.update(coordinator.cache.state.stats())
                counters["cache_digest"] = coordinator.cache.state.digest
                counters["in_flight_slots"] = coordinator.cache.io.transfers.in_flight.count()
                moved = coordinator.cache.io.transfers.counters()
                # Jobs of an ended session the movers refused (DESIGN rule 10).
                counters["refused_late_jobs"] = sum(moved["refused_jobs"].values())
                for (src, dst), pages in moved["pages_moved"].items():
                    counters[f"pages_moved_{src}_to_{dst}"] = pages
                    counters[f"bytes_moved_{src}_to_{dst}"] = moved["bytes_moved"][(src, dst)]
                storage = coordinator.cache.io.transfers.tiers.storage
                if storage is not None:
                    counters.update(storage.counters())
            counters["rejected_steps"] = coordinator.rejected_steps
            counters.update(phase_counters(coordinator, self._engine))
        return counters

    def placement(self) -> tuple[Topology, int]:
        """This daemon's deployment and its rank in it."""
        return self._topology, self.config.rank

    def status(self) -> DaemonStatus:
        coordinator, engine = self._coordinator, self._engine
        failure = engine.failure if engine is not None else None
        return DaemonStatus(
            rank=self.config.rank,
            world_size=self._topology.world_size,
            domain_ranks=tuple(self._domain.ranks),
            mode=self.config.mode,
            agreement_lag=self.config.agreement_lag,
            last_step=coordinator.last_step if coordinator else 0,
            rounds_completed=engine.rounds_completed if engine else 0,
            open_questions=coordinator.open_questions if coordinator else 0,
            state=self.state.value,
            failure=str(failure) if failure else "",
            metrics_port=self.metrics_port,
            attached=bool(coordinator and coordinator.cache),
            epoch=self.epoch,
        )

    # -- lifecycle ----------------------------------------------------------

    async def run(self) -> ExitCode:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)
        await self._start_servers()
        if self.config.metrics_address:
            self.metrics_port = (await metrics.serve(self.metrics, self.config.metrics_address)).port
            log.info("metrics on port %d", self.metrics_port)
        if self._watchdog_s:
            self._spawn(self._watchdog(), "watchdog")
        self.state = State.JOINING
        self.notifier.status(f"joining {len(self._domain.ranks)} ranks at {self.config.rendezvous}")
        if self.notifier.enabled:  # systemd's start timeout runs while the peers are awaited
            self._spawn(extend_timeout_while(self.notifier, lambda: self.state is State.JOINING), "extend-start")
        joining = _on_daemon_thread(self._join, "rendezvous")  # a stop meanwhile must not wait for it
        stop = asyncio.ensure_future(self._stop_requested.wait())
        await asyncio.wait((joining, stop), return_when=asyncio.FIRST_COMPLETED)
        if not joining.done():
            log.info("stop requested while joining peers")
            joining.cancel()
            await self._shutdown()
            return ExitCode.STOPPED
        stop.cancel()
        try:
            formed = joining.result()
        except (RuntimeError, CacheError) as exc:
            log.error("rendezvous failed: %s", exc)
            await self._shutdown()
            return ExitCode.RENDEZVOUS_FAILED
        await self._serve_epoch(formed)
        self.notifier.ready(f"serving rank {self.config.rank} of domain {list(self._domain.ranks)}")
        log.info("serving rank %d of domain %s in epoch %d (%s mode, lag %d)", self.config.rank,
                 list(self._domain.ranks), self.epoch, self.config.mode, self.config.agreement_lag)
        threading.Thread(target=self._watch_epochs, args=(loop,), name="epoch-watch", daemon=True).start()
        await self._stop_requested.wait()
        broken = self.state in (State.BROKEN, State.REFORMING)
        await self._shutdown()
        if self._crashed:
            return ExitCode.INTERNAL
        return ExitCode.PEER_LOST if broken else ExitCode.STOPPED

    def _join(self) -> _Formed:
        """Blocking rendezvous, on a worker thread: the deployment's current
        epoch, or the next one when the current one formed without this rank
        (it restarted)."""
        if self.config.host_store:
            host, port = split_host_port(self.config.rendezvous)
            self._store_server = host_store(host, port)
        store = self._epochs.base.connect()
        return self._form(store, self._epochs.to_join(store, self.config.epoch), b"")

    def _form(self, store: TCPStore, epoch: int, offer: bytes) -> _Formed:
        """Join `epoch` with every rank of the domain, then trade what each
        carries over (blocking, on a worker thread)."""
        self._rdzv = self._epochs.rendezvous(epoch)
        if self._heartbeat is not None:
            self._heartbeat.stop()
        self._heartbeat = Heartbeat(self._rdzv, self.config.rank, self.config.heartbeat_interval_s)
        self._heartbeat.start()
        reducer = build_reducer(
            store, self._rdzv, self._topology, self.config.rank, self.config.mode,
            self.config.agreement_timeout_s, self.config.gloo_host,
        )
        confirmer: Reducer | None = None
        try:
            confirmer = confirmation_reducer(store, self._rdzv, self._domain, self.config.rank,
                                             self.config.agreement_timeout_s, self.config.gloo_host)
            offers = self._epochs.exchange(store, epoch, self.config.rank, tuple(self._domain.ranks), offer,
                                           self.config.rendezvous_timeout_s)
            self._epochs.mark_formed(store, epoch)
        except BaseException:
            reducer.close()
            if confirmer is not None:
                confirmer.close()
            raise
        diagnosis_store = None
        with contextlib.suppress(RuntimeError):  # without it, a diagnosis connects when it needs to
            diagnosis_store = self._rdzv.connect()
        return _Formed(reducer, confirmer, offers, diagnosis_store)

    async def _serve_epoch(self, formed: _Formed) -> None:
        """Decide in the epoch just formed: a new engine and stepper, and the
        carried-over cache (the pages every rank offered alike), if any."""
        loop = asyncio.get_running_loop()
        reducer, offers = formed.reducer, formed.offers
        self._confirmer = formed.confirmer
        engine = AgreementEngine(
            reducer,
            DivergenceExchange(
                self._rdzv.connect(), self._rdzv.namespace, self.config.rank, self._domain.ranks,
                self.config.agreement_timeout_s,
            ),
            functools.partial(self._diagnose, formed.diagnosis_store),
            heartbeat=self._heartbeat,
            faults=FaultInjection(self.config.fault_delay_ms, self.config.fault_seed + self.config.rank),
            on_failure=lambda failure: loop.call_soon_threadsafe(self._on_broken, failure, engine),
        )
        self._engine = engine
        self._coordinator = Stepper(engine, self.config.rank, self.config.agreement_lag, self.epoch)
        decoded = [carryover.decode(offer) for offer in offers]
        kept = carryover.common([o.pages for o in decoded])
        # Every rank's cache of this epoch starts with these slots retired,
        # kept or new alike, so all of them allocate the same slots.
        busy = self._epoch_busy = carryover.busy_slots(decoded, kept)
        if self._kept is not None:
            runtime, descriptor = self._kept
            self._kept = (carry_over(runtime, kept, busy, self.config.storage_timeout_s), descriptor)
            log.info("epoch %d carries %d host pages over (until the scheduler attaches again); %d slots wait "
                     "for I/O to end", self.epoch, len(kept), len(busy))
        self.state = State.SERVING
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)

    async def reform(self, reason: str) -> None:
        """Form the domain again in the next epoch (once, however many ask)."""
        if self._reforming is None or self._reforming.done():
            self._reforming = asyncio.ensure_future(self._reform(reason))
        await asyncio.shield(self._reforming)

    async def _reform(self, reason: str) -> None:
        if self.state not in (State.SERVING, State.BROKEN):
            return
        leaving = self.epoch
        self.state, self._reform_reason = State.REFORMING, reason
        self.reforms += 1
        log.warning("leaving epoch %d: %s", leaving, reason)
        self.notifier.status(f"re-forming out of epoch {leaving}: {reason}"[:400])
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        attaching = self._attach_task
        if attaching is not None and not attaching.done():
            # An Attach being decided is answered from its one decision on
            # every rank (never refused here after its peers were told
            # "attached"); the session it opens then ends with this epoch.
            await asyncio.wait({attaching})
        engine, stepper = self._engine, self._coordinator
        self._engine = self._coordinator = None  # no step reaches them from here
        if engine is not None:
            # Really joined: a round still in its collective ends within the
            # collective's own timeout; rounds not begun fail.
            await _on_daemon_thread(functools.partial(engine.close, None, f"epoch {leaving} was left"),
                                    "close-epoch")
        if stepper is not None:
            # A round that completed is agreed: a peer that completed it
            # applies it, so this rank does too (and answers its step alike),
            # before its I/O drains below; then nothing more applies.
            await stepper.settle_in_flight()
            stepper.leave(f"rank {self.config.rank} left epoch {leaving} ({reason})")
        confirmer, self._confirmer = self._confirmer, None
        if confirmer is not None:  # no Attach is being decided (awaited above)
            await _on_daemon_thread(confirmer.close, "close-confirm")
        offer = await self._detach_for_epoch(stepper)
        while not self._stop_requested.is_set():
            forming = _on_daemon_thread(functools.partial(self._rejoin, leaving, offer), "re-form")
            stop = asyncio.ensure_future(self._stop_requested.wait())
            await asyncio.wait((forming, stop), return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if not forming.done():
                forming.cancel()
                return  # stopping: the shutdown follows
            try:
                formed = forming.result()
            except (RuntimeError, CacheError) as exc:
                log.warning("epoch %d did not form (%s); trying the next", self.epoch, exc)
                leaving = self.epoch
                continue
            await self._serve_epoch(formed)
            log.info("serving rank %d in epoch %d", self.config.rank, self.epoch)
            self.notifier.status(f"serving rank {self.config.rank} in epoch {self.epoch}")
            return

    def _rejoin(self, leaving: int, offer: bytes) -> _Formed:
        store = self._epochs.base.connect()
        return self._form(store, self._epochs.advance(store, leaving), offer)

    async def _detach_for_epoch(self, stepper: Stepper | None) -> bytes:
        """Keep the cache of the ending epoch for the scheduler's next attach,
        once this rank's I/O has drained (DESIGN rule 5); what it may offer."""
        runtime = stepper.cache if stepper is not None else None
        descriptor = self._descriptor
        if runtime is None and self._kept is not None:
            runtime, descriptor = self._kept
        if runtime is None or descriptor is None:
            return b""
        # The session ends: its jobs not yet started are refused from now on,
        # and its pool is let go only once none of its jobs touches it
        # (counted: only copies already running remain, and they end).
        session = runtime.io.session
        session.end()
        await _on_daemon_thread(session.wait_device_quiet, "device-quiet")
        drain_s = 2 * self.config.storage_timeout_s + 5.0
        idle = await asyncio.to_thread(runtime.io.transfers.in_flight.wait_all_idle, drain_s)
        self._kept, self._descriptor = (runtime, descriptor), None
        if not idle:
            busy = runtime.io.transfers.in_flight.slots()
            log.warning("I/O still in flight after %.0fs on %d slots: this rank carries no pages over, and "
                        "those slots stay out of use until it ends", drain_s, len(busy))
            return carryover.encode([], busy)
        return carryover.encode(carryover.offer(runtime.state.index))

    def _watch_epochs(self, loop: asyncio.AbstractEventLoop) -> None:
        """On a daemon thread: notice the deployment moving to a later epoch
        (a restarted rank started one), and leave this one."""
        store: TCPStore | None = None
        stopped = threading.Event()
        interval = max(0.2, 2 * self.config.heartbeat_interval_s)
        while not stopped.wait(interval):
            if self.state is State.STOPPED or self.state is State.DRAINING:
                return
            try:
                store = store or self._epochs.base.connect(timeout_s=max(1.0, 5 * interval))
                current = self._epochs.current(store)
                serving = self.epoch
                if current < serving and self.state is State.SERVING and self._epochs.restore(store, serving):
                    log.warning("the rendezvous store read epoch %d below this domain's %d (it restarted); "
                                "wrote %d back so that epochs only grow", current, serving, serving)
            except Exception:  # the store is away (or answered nonsense): the rounds will say what that means
                store = None
                continue
            if current > self.epoch and self.state is State.SERVING:
                with contextlib.suppress(RuntimeError):  # the loop is closed: the daemon has stopped
                    loop.call_soon_threadsafe(self._epoch_moved, current)

    def _epoch_moved(self, current: int) -> None:
        if self.state is State.SERVING and current > self.epoch:
            self._spawn(self.reform(f"the deployment moved to epoch {current}"), "re-form")

    def _diagnose(self, store: TCPStore | None, round_number: int, exc: BaseException) -> PeerLost:
        peers = tuple(r for r in self._domain.ranks if r != self.config.rank)
        window = max(0.3, 3 * self.config.heartbeat_interval_s)
        return peer_lost(round_number, exc, diagnose(self._rdzv, peers, round_number, window, store))

    def _on_broken(self, failure: CacheError, engine: AgreementEngine | None = None) -> None:
        if engine is not None and engine is not self._engine:
            return  # an epoch already left
        if isinstance(failure, PeerLost) and self.state is State.SERVING:
            self._spawn(self.reform(str(failure)), "re-form")
            return
        if self.state is State.SERVING:
            self.state = State.BROKEN
            self.notifier.status(f"broken: {failure}"[:400])
            self._spawn(self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING), "health")

    def _on_signal(self) -> None:
        self._signals += 1
        if self._signals > 1:
            log.warning("second signal: exiting without draining")
            os._exit(ExitCode.FORCED)
        self._stop_requested.set()

    async def _shutdown(self) -> None:
        previous = self.state
        self.state = State.DRAINING
        self.notifier.stopping(f"draining {self._in_flight} calls")
        self.notifier.extend_timeout(self.config.drain_s + 10.0)  # the drain, then closing the backends
        await self._health.enter_graceful_shutdown()
        log.info("draining %d in-flight calls (was %s)", self._in_flight, previous.value)
        try:
            await asyncio.wait_for(self._idle.wait(), self.config.drain_s)
        except TimeoutError:
            log.warning("%d calls still in flight after %.1fs; stopping anyway", self._in_flight, self.config.drain_s)
        for server in self._servers:
            await server.stop(grace=1.0)
        if self._engine is not None:
            await asyncio.to_thread(self._engine.close)
        if self._confirmer is not None:
            await asyncio.to_thread(self._confirmer.close)
        if self._coordinator is not None and self._coordinator.cache is not None:
            await _bounded(self._coordinator.cache.io.transfers.close, 5.0, "closing the storage backend")
        if self._kept is not None:
            await _bounded(self._kept[0].io.transfers.close, 5.0, "closing the kept storage backend")
        if self._heartbeat is not None:
            self._heartbeat.stop()
        self._store_server = None
        release_unix(self.config.socket_path)  # only the socket this daemon bound
        if self._pools is not None:
            self._pools.close()
        for task in list(self._background):
            task.cancel()
        self.state = State.STOPPED
        log.info("stopped")

    async def _watchdog(self) -> None:
        """Ping systemd from the event loop itself: a stuck loop stops pinging."""
        while self.state is not State.STOPPED:
            self.notifier.watchdog()
            await asyncio.sleep(self._watchdog_s)

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        for service in ("", SERVICE_NAME):
            await self._health.set(service, status)

    async def _start_servers(self) -> None:
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self._servers = await start_listeners(self.config, self._new_server)
        # Pools come by descriptor, beside the socket, with its mode and group.
        self._pools = PoolHandover(self.config.socket_path + POOLS_SUFFIX, self.config.socket_group)
        self._pools.start()

    def _new_server(self, interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                    options: Sequence[tuple[str, int]] = ()) -> grpc.aio.Server:
        # Above the limit gRPC answers RESOURCE_EXHAUSTED instead of queueing.
        # The metrics interceptor comes first, so refused calls are counted too.
        # Twice the message limit: a request between the two gets a clear
        # INVALID_ARGUMENT from the handler (`status.tolerant`) rather than
        # gRPC's own RESOURCE_EXHAUSTED, which also means "pool full" here.
        limits = [("grpc.max_receive_message_length", 2 * MAX_MESSAGE_BYTES),
                  ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                  *budget.grpc_options()]
        server = grpc.aio.server(interceptors=[self.metrics.rpc, *interceptors], options=[*limits, *options],
                                 maximum_concurrent_rpcs=self.config.max_concurrent_rpcs)
        server.add_generic_rpc_handlers((service_handler(CacheDaemonServicer(self)),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        # Reflection: grpcurl and friends list and call the API without the proto.
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server)
        return server

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        """A background task, watched: its crash stops the daemon in order."""
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._background.add(task)
        task.add_done_callback(self._background_ended)

    def _background_ended(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        log.error("background task %s crashed; stopping", task.get_name(), exc_info=task.exception())
        self._crashed = True
        self._stop_requested.set()


def service_handler(servicer: CacheDaemonServicer) -> grpc.GenericRpcHandler:
    """The CacheDaemon service, as the generated code registers it, except
    that a request body that does not decode reaches the handler (and is
    answered INVALID_ARGUMENT) instead of escaping as UNKNOWN."""
    service = pb.DESCRIPTOR.services_by_name["CacheDaemon"]
    handlers = {}
    for method in service.methods:
        request_class = message_factory.GetMessageClass(method.input_type)
        reply_class = message_factory.GetMessageClass(method.output_type)
        kind = (grpc.stream_stream_rpc_method_handler if method.client_streaming and method.server_streaming
                else grpc.unary_unary_rpc_method_handler)
        handlers[method.name] = kind(
            getattr(servicer, method.name),
            request_deserializer=tolerant(request_class.FromString),
            response_serializer=reply_class.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def _on_daemon_thread(fn: Callable[[], T], name: str) -> asyncio.Future[T]:
    """`fn` on a daemon thread, as a future of the running loop. Unlike
    `asyncio.to_thread`, the loop's close does not wait for it: a stop
    requested while the rendezvous blocks exits at once, not after
    `rendezvous_timeout_s`."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, exc: BaseException | None) -> None:
        if future.done():  # cancelled: nobody waits for it any more
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def call() -> None:
        try:
            outcome: tuple[T | None, BaseException | None] = (fn(), None)
        except BaseException as exc:
            outcome = (None, exc)
        with contextlib.suppress(RuntimeError):  # the loop is closed: the daemon has stopped
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=call, name=name, daemon=True).start()
    return future


async def _bounded(fn: Callable[[], object], timeout_s: float, what: str) -> None:
    """Run a blocking call on a daemon thread and wait at most `timeout_s`:
    a storage that hangs must not hold the daemon's exit."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def finish() -> None:
        if not done.done():
            done.set_result(None)

    def call() -> None:
        try:
            fn()
        finally:
            loop.call_soon_threadsafe(finish)

    threading.Thread(target=call, name=what, daemon=True).start()
    try:
        await asyncio.wait_for(done, timeout_s)
    except TimeoutError:
        log.warning("%s did not finish within %.0fs; exiting without it", what, timeout_s)
