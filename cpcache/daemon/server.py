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
import logging
import os
import signal
import threading
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import grpc
from google.protobuf import message_factory
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from torch.distributed import TCPStore

from cpcache.agreement.attach import agree_on_attach, withdraw
from cpcache.agreement.collective import Reducer, Rendezvous, build_reducer, host_store
from cpcache.agreement.engine import AgreementEngine, DivergenceExchange, FaultInjection, peer_lost
from cpcache.agreement.liveness import Heartbeat, diagnose
from cpcache.config import DaemonConfig
from cpcache.daemon import metrics
from cpcache.daemon.listeners import release_unix, start_listeners
from cpcache.daemon.metrics import DaemonCollector
from cpcache.daemon.servicer import CacheDaemonServicer
from cpcache.daemon.status import tolerant
from cpcache.daemon.systemd import Notifier, extend_timeout_while
from cpcache.daemon.wire import Attached, DaemonStatus
from cpcache.dataplane.pools import DevicePool
from cpcache.errors import CacheError, FailedPrecondition, PeerLost, Unavailable
from cpcache.geometry import KVGeometry
from cpcache.keys import namespace_seed
from cpcache.rank.assembly import CacheRuntime, check_host_budget, open_cache
from cpcache.rank.stepper import Stepper
from cpcache.v1 import daemon_pb2 as pb
from cpcache.values import MAX_MESSAGE_BYTES, split_host_port

log = logging.getLogger("cpcached")

T = TypeVar("T")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["CacheDaemon"].full_name


class State(enum.Enum):
    STARTING = "starting"
    JOINING = "joining"  # rendezvous with the peers
    SERVING = "serving"
    BROKEN = "broken"  # a peer was lost: decisions are refused
    DRAINING = "draining"
    STOPPED = "stopped"


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
        self._rdzv = Rendezvous(
            *split_host_port(config.rendezvous), config.deployment, config.epoch, config.rendezvous_timeout_s
        )
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
        self._attaching = False
        self._attach_attempts = 0  # attaches that reached the agreement: tells a peer's stale one
        self._crashed = False  # a background task died: exit INTERNAL after the drain

    # -- what the servicer and the metrics see -----------------------------

    @property
    def engine(self) -> AgreementEngine | None:
        return self._engine

    @property
    def coordinator(self) -> Stepper | None:
        return self._coordinator

    def admit_decision(self) -> Stepper:
        if self.state is State.SERVING and self._coordinator is not None:
            return self._coordinator
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
        stepper = self.admit_decision()
        if stepper.cache is not None:
            raise FailedPrecondition("a device pool is already attached to this daemon")
        if self._attaching:
            raise FailedPrecondition("an Attach is already in progress on this daemon")
        self._attaching = True
        runtime: CacheRuntime | None = None
        differs = False
        store = self._rdzv.connect()
        try:
            runtime = await asyncio.to_thread(self._open_cache, model_id, geometry, device_pages, kind, pool)
            descriptor = self._attach_descriptor(model_id, geometry, device_pages)
            try:
                self._attach_attempts += 1
                await asyncio.to_thread(agree_on_attach, store, self._rdzv.namespace, self.config.rank,
                                        self._domain.ranks, descriptor, self._attach_attempts,
                                        self.config.agreement_timeout_s)
            except FailedPrecondition:
                differs = True  # the ranks attached different things: every rank must see it
                raise
        except BaseException:
            if not differs:
                # Withdrawn, so a peer's retry never matches this failed attempt.
                await asyncio.to_thread(withdraw, store, self._rdzv.namespace, self.config.rank)
            if runtime is not None:
                runtime.io.transfers.close()
            raise
        finally:
            self._attaching = False
        stepper.cache = runtime
        self._key_seed = namespace_seed(model_id, geometry.dtype, self.config.host_layout, geometry.page_size)
        log.info("attached %r: %d device pages of %d bytes (%s)", model_id, device_pages, geometry.page_bytes, kind)
        storage = runtime.io.transfers.tiers.storage
        return Attached(geometry.page_bytes, self.config.host_pool_pages, self.config.host_layout,
                        storage.name if storage else "none", self._key_seed)

    def _open_cache(self, model_id: str, geometry: KVGeometry, device_pages: int, kind: str,
                    pool: str | pb.CudaIpcHandle) -> CacheRuntime:
        check_host_budget(self.config, geometry)
        if isinstance(pool, str):
            device = DevicePool.from_shared_file(pool, geometry, device_pages)
        else:
            handle = {f.name: getattr(pool, f.name) for f in pool.DESCRIPTOR.fields}
            device = DevicePool.from_cuda_ipc(handle, geometry, device_pages)
        return open_cache(self.config, geometry, device, model_id)

    def _attach_descriptor(self, model_id: str, geometry: KVGeometry, device_pages: int) -> dict[str, Any]:
        """What must be the same on every rank: it shapes the shared state."""
        return {"model_id": model_id, "geometry": dataclasses.asdict(geometry), "device_pages": device_pages,
                "host_pool_pages": self.config.host_pool_pages, "host_layout": self.config.host_layout,
                "cache": dataclasses.asdict(self.config.cache_config)}

    def stats(self) -> dict[str, int]:
        counters = {"rounds_completed": self._engine.rounds_completed if self._engine else 0}
        coordinator = self._coordinator
        if coordinator is not None:
            counters["last_step"] = coordinator.last_step
            counters["decisions"] = coordinator.decision_count
            if coordinator.cache is not None:
                counters.update(coordinator.cache.state.stats())
                counters["cache_digest"] = coordinator.cache.state.digest
                counters["in_flight_slots"] = coordinator.cache.io.transfers.in_flight.count()
                moved = coordinator.cache.io.transfers.counters()
                for (src, dst), pages in moved["pages_moved"].items():
                    counters[f"pages_moved_{src}_to_{dst}"] = pages
                    counters[f"bytes_moved_{src}_to_{dst}"] = moved["bytes_moved"][(src, dst)]
                storage = coordinator.cache.io.transfers.tiers.storage
                if storage is not None:
                    counters.update(storage.counters())
            counters["rejected_steps"] = coordinator.rejected_steps
        return counters

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
        )

    # -- lifecycle ----------------------------------------------------------

    async def run(self) -> ExitCode:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)
        await self._start_servers()
        if self.config.metrics_address:
            self.metrics_port = metrics.serve(self.metrics, self.config.metrics_address)
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
            reducer = joining.result()
        except (RuntimeError, CacheError) as exc:
            log.error("rendezvous failed: %s", exc)
            await self._shutdown()
            return ExitCode.RENDEZVOUS_FAILED
        self._engine = AgreementEngine(
            reducer,
            DivergenceExchange(
                self._rdzv.connect(), self._rdzv.namespace, self.config.rank, self._domain.ranks,
                self.config.agreement_timeout_s,
            ),
            self._diagnose,
            heartbeat=self._heartbeat,
            faults=FaultInjection(self.config.fault_delay_ms, self.config.fault_seed + self.config.rank),
            on_failure=lambda failure: loop.call_soon_threadsafe(self._on_broken, failure),
        )
        self._coordinator = Stepper(self._engine, self.config.rank, self.config.agreement_lag)
        self.state = State.SERVING
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self.notifier.ready(f"serving rank {self.config.rank} of domain {list(self._domain.ranks)}")
        log.info("serving rank %d of domain %s (%s mode, lag %d)", self.config.rank, list(self._domain.ranks),
                 self.config.mode, self.config.agreement_lag)
        await self._stop_requested.wait()
        broken = self.state is State.BROKEN
        await self._shutdown()
        if self._crashed:
            return ExitCode.INTERNAL
        return ExitCode.PEER_LOST if broken else ExitCode.STOPPED

    def _join(self) -> Reducer:
        """Blocking rendezvous, on a worker thread."""
        if self.config.host_store:
            host, port = split_host_port(self.config.rendezvous)
            self._store_server = host_store(host, port)
        store = self._rdzv.connect()
        self._heartbeat = Heartbeat(self._rdzv, self.config.rank, self.config.heartbeat_interval_s)
        self._heartbeat.start()
        return build_reducer(
            store, self._rdzv, self._topology, self.config.rank, self.config.mode,
            self.config.agreement_timeout_s, self.config.gloo_host,
        )

    def _diagnose(self, round_number: int, exc: BaseException) -> PeerLost:
        peers = tuple(r for r in self._domain.ranks if r != self.config.rank)
        window = max(0.3, 3 * self.config.heartbeat_interval_s)
        return peer_lost(round_number, exc, diagnose(self._rdzv, peers, round_number, window))

    def _on_broken(self, failure: CacheError) -> None:
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
        if self._coordinator is not None and self._coordinator.cache is not None:
            await _bounded(self._coordinator.cache.io.transfers.close, 5.0, "closing the storage backend")
        if self._heartbeat is not None:
            self._heartbeat.stop()
        self._store_server = None
        release_unix(self.config.socket_path)  # only the socket this daemon bound
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

    def _new_server(self, interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                    options: Sequence[tuple[str, int]] = ()) -> grpc.aio.Server:
        # Above the limit gRPC answers RESOURCE_EXHAUSTED instead of queueing.
        # The metrics interceptor comes first, so refused calls are counted too.
        # Twice the message limit: a request between the two gets a clear
        # INVALID_ARGUMENT from the handler (`status.tolerant`) rather than
        # gRPC's own RESOURCE_EXHAUSTED, which also means "pool full" here.
        limits = [("grpc.max_receive_message_length", 2 * MAX_MESSAGE_BYTES),
                  ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
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
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
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
