"""The daemon's lifecycle: start, rendezvous, serve, drain, stop.

The lifecycle moves one way: STARTING -> JOINING -> SERVING -> DRAINING ->
STOPPED (a stop while joining, or a rendezvous that failed, goes from
JOINING to DRAINING). While SERVING, the rank's own standing in its domain
(`rank.standing.Standing`: serving, re-forming into a later epoch, broken)
says whether it decides; health is SERVING only while both are. Signal
handlers only set an event; a second signal forces exit.
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
import time
from collections.abc import Coroutine, Iterator
from typing import Any

import grpc

import cpcache
from cpcache.agreement.bounded import bounded_async
from cpcache.config import DaemonConfig
from cpcache.daemon import metrics
from cpcache.daemon.call_limits import CallCounts
from cpcache.daemon.device_pools import open_device
from cpcache.daemon.grpc_server import new_server, set_health
from cpcache.daemon.health import DrainingHealth
from cpcache.daemon.listeners import release_unix, start_listeners
from cpcache.daemon.metrics import DaemonCollector
from cpcache.daemon.pool_handover import SUFFIX as POOLS_SUFFIX
from cpcache.daemon.pool_handover import PoolHandover
from cpcache.daemon.servicer import CacheDaemonServicer
from cpcache.daemon.systemd import Notifier, extend_timeout_while
from cpcache.daemon.wire import AttachAsk, DaemonStatus, step_error, step_reply
from cpcache.errors import CacheError, Unavailable
from cpcache.rank.attach import Attached
from cpcache.rank.rank import Rank
from cpcache.rank.standing import Standing
from cpcache.rank.stepper import StepAnswer
from cpcache.step_outcomes import OutcomeWriter
from cpcache.v1 import daemon_pb2 as pb

log = logging.getLogger("cpcached")


class Lifecycle(enum.Enum):
    STARTING = "starting"
    JOINING = "joining"  # rendezvous with the peers
    SERVING = "serving"
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
        self.lifecycle = Lifecycle.STARTING
        self.stop_requested = asyncio.Event()
        self.rank = Rank(config, self)
        # Every step's outcome, where this rank's scheduler reads it after this daemon's death.
        self.outcomes = OutcomeWriter()
        self.rank.formation.record_outcome = self._record_outcome
        self.metrics = DaemonCollector(self)
        self.metrics_port = 0
        self.calls = CallCounts()  # every listener's call shares, as counted
        self._health = DrainingHealth()
        self._servers: list[grpc.aio.Server] = []
        self._pools: PoolHandover | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._in_flight = 0
        self._signals = 0
        self._background: set[asyncio.Task] = set()
        self._crashed = False  # a background task died: exit INTERNAL after the drain

    # -- what the servicer, the metrics and the rank see ----------------------

    def not_serving(self) -> str | None:
        return None if self.lifecycle is Lifecycle.SERVING else self.lifecycle.value

    async def standing_changed(self, standing: Standing, note: str) -> None:
        if note:
            self.notifier.status(note[:400])
        await set_health(self._health, standing is Standing.SERVING)

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

    async def attach_pool(self, ask: AttachAsk) -> Attached:
        """Open the pool `ask` hands over and have the domain attach it; a
        host pool in shared memory is offered back by ticket."""
        rank = self.rank
        attached = await rank.attacher.decide(ask.model_id, ask.geometry, ask.device_pages, ask.pool.kind,
                                              functools.partial(open_device, ask, self._take), ask.model_dtype,
                                              ask.attempt)
        attached = dataclasses.replace(attached, daemon_instance=self.outcomes.instance)
        try:
            host = rank.attached_runtime().io.transfers.tiers.host
        except CacheError:
            # A retry told the attach of a session whose epoch has ended: its
            # first step fails on every rank alike; there is no pool to offer.
            return attached
        if host.fd >= 0 and self._pools is not None:
            attached = dataclasses.replace(attached, host_pool_ticket=self._pools.offer_host_pool(host))
        return attached

    def _record_outcome(self, epoch: int, step: int, outcome: StepAnswer | CacheError) -> None:
        told = (pb.OutcomeReply(error=step_error(outcome)) if isinstance(outcome, CacheError)
                else pb.OutcomeReply(reply=step_reply(outcome)))
        payload = told.SerializeToString()
        if not self.outcomes.record(epoch, step, payload):
            log.warning("step %d: its outcome (%d bytes) is larger than half the outcome ring and is not "
                        "recorded; a scheduler that loses this daemon before the reply asks the peers", step,
                        len(payload))

    def _take(self, ticket: str) -> tuple[int, int, int]:
        """A descriptor handed over on the `.pools` socket: -> (fd, uid, pid)."""
        if self._pools is None:
            raise Unavailable("attach: the pool handover socket is not open yet")
        return self._pools.take(ticket)

    def handover_stats(self) -> dict[str, int]:
        """What the pool handover refused or waited out, and the tickets it
        holds (docs/security.md, "Resource budget"); none before it starts.
        The `Stats` RPC and the metrics both read it here."""
        return self._pools.stats() if self._pools is not None else {}

    def stats(self) -> dict[str, int]:
        return {**self.rank.stats().counters(), **self.handover_stats(), **self.calls.counters()}

    def status(self) -> DaemonStatus:
        rank, stats, failure = self.rank, self.rank.stats(), self.rank.failure
        return DaemonStatus(
            rank=self.config.rank,
            world_size=self.config.topology.world_size,
            domain_ranks=rank.domain_ranks,
            mode=self.config.mode,
            agreement_lag=self.config.agreement_lag,
            last_step=stats.steps.last_step if stats.steps else 0,
            rounds_completed=stats.engine.rounds if stats.engine else 0,
            open_questions=stats.steps.open_questions if stats.steps else 0,
            state=rank.standing.value if self.lifecycle is Lifecycle.SERVING else self.lifecycle.value,
            failure=str(failure) if failure else "",
            metrics_port=self.metrics_port,
            attached=rank.attached,
            epoch=rank.epoch,
            agreement_timeout_s=self.config.agreement_timeout_s,
            version=cpcache.__version__,
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
            self.spawn(self._watchdog(), "watchdog")
        self.lifecycle = Lifecycle.JOINING
        ranks = list(self.rank.domain_ranks)
        self.notifier.status(f"joining {len(ranks)} ranks at {self.config.rendezvous}")
        if self.notifier.enabled:  # systemd's start timeout runs while the peers are awaited
            self.spawn(extend_timeout_while(self.notifier, lambda: self.lifecycle is Lifecycle.JOINING),
                       "extend-start")
        # On a thread of its own: a stop meanwhile must not wait for it.
        joining = asyncio.ensure_future(bounded_async(self.rank.formation.join, None, "rendezvous"))
        stop = asyncio.ensure_future(self.stop_requested.wait())
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
        # No await until the rank serves: no call sees the daemon serving
        # while its rank is still forming.
        self.lifecycle = Lifecycle.SERVING
        await self.rank.formation.serve(formed)
        self.notifier.ready(f"serving rank {self.config.rank} of domain {ranks}")
        log.info("serving rank %d of domain %s in epoch %d (%s mode, lag %d)", self.config.rank,
                 ranks, self.rank.epoch, self.config.mode, self.config.agreement_lag)
        self.rank.formation.watch(loop)
        await self.stop_requested.wait()
        broken = self.rank.standing in (Standing.BROKEN, Standing.REFORMING)
        await self._shutdown()
        if self._crashed:
            return ExitCode.INTERNAL
        return ExitCode.PEER_LOST if broken else ExitCode.STOPPED

    def _on_signal(self) -> None:
        self._signals += 1
        if self._signals > 1:
            log.warning("second signal: exiting without draining")
            os._exit(ExitCode.FORCED)
        self.stop_requested.set()

    async def _shutdown(self) -> None:
        previous = self.lifecycle
        self.lifecycle = Lifecycle.DRAINING
        self.notifier.stopping(f"draining {self._in_flight} calls")
        self.notifier.extend_timeout(self.config.drain_s + 10.0)  # the drain, then closing the backends
        await self._health.enter_graceful_shutdown()
        log.info("draining %d in-flight calls (was %s)", self._in_flight, previous.value)
        # One deadline for the calls in flight and the copies issued: both
        # have run since the signal (docs/design.md rule 12: a forward may be reading
        # a load, so its copies end before the exit, bounded).
        deadline = time.monotonic() + self.config.drain_s
        # The steps taken are answered before the server stops (their
        # rounds end within agreement_timeout_s, which drain_s outlasts),
        # then the calls in flight, retries of those steps among them.
        await self.rank.formation.settle_steps(self.config.drain_s)
        try:
            await asyncio.wait_for(self._idle.wait(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            log.warning("%d calls still in flight after %.1fs; stopping anyway", self._in_flight, self.config.drain_s)
        for server in self._servers:
            await server.stop(grace=1.0)
        await self.rank.formation.close(deadline - time.monotonic())
        release_unix(self.config.socket_path)  # only the socket this daemon bound
        if self._pools is not None:
            self._pools.close()
        for task in list(self._background):
            task.cancel()
        self.lifecycle = Lifecycle.STOPPED
        log.info("stopped")

    async def _watchdog(self) -> None:
        """Ping systemd from the event loop itself: a stuck loop stops pinging."""
        while self.lifecycle is not Lifecycle.STOPPED:
            self.notifier.watchdog()
            await asyncio.sleep(self._watchdog_s)

    async def _start_servers(self) -> None:
        await set_health(self._health, False)
        servicer = CacheDaemonServicer(self, self.config.steps_idle_s, self.calls)
        self._servers = await start_listeners(
            self.config, functools.partial(new_server, self.config, servicer, self._health, self.metrics.rpc,
                                           calls=self.calls))
        # Pools come by descriptor, beside the socket, with its mode and group.
        self._pools = PoolHandover(self.config.socket_path + POOLS_SUFFIX, self.config.socket_group,
                                   self.outcomes.fd)
        self._pools.start()

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
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
        self.stop_requested.set()
