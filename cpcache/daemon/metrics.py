"""Prometheus metrics on an optional HTTP port, named after the Prometheus
naming guide: base units in the name, `_total` on counters only, one label
per dimension, and the rank labels SGLang puts on its own cache metrics
(`tp_rank`, `pp_rank`, `dp_rank`, plus `cp_rank` and the global `rank`), so
dashboards join the two.

Scrapes are formatted on the endpoint's own thread (`metrics_http`), but the values they read
belong to the daemon's event loop (shared state, open questions, RPC
counts). A scrape therefore never reads them itself: it asks the loop for a
snapshot (`call_soon_threadsafe`) and formats what comes back. Per-RPC
counts and latencies (`grpc_server_handled_total`,
`grpc_server_handling_seconds`, as go-grpc-prometheus and grpc-ecosystem
name them) come from a server interceptor that runs on the loop too."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import logging
import platform
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import descriptor_pool
from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

import cpcache
from cpcache.agreement.engine import ROUND_BOUNDS_S
from cpcache.daemon.metrics_http import MetricsServer
from cpcache.histogram import Histogram
from cpcache.rank.phases import PHASE_BOUNDS_S
from cpcache.rank.stats import RankStats
from cpcache.topology import Topology
from cpcache.values import split_host_port

log = logging.getLogger(__name__)

# Unary calls on a unix socket take well under a millisecond; Attach and
# steps that wait for peers take seconds.
RPC_BOUNDS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
HANDOVER_PREFIX = "pool_handover_"  # the handover's counters in `Daemon.handover_stats`
SNAPSHOT_TIMEOUT_S = 5.0  # a loop that cannot answer a scrape in this long: the scrape gets what is safe


def rank_labels(topology: Topology, rank: int) -> dict[str, str]:
    """The labels every cpcache series carries. SGLang labels its radix and
    storage cache metrics (`radix_cache_metric_labels`) with the attention
    TP and DP ranks when DP attention is on, else the TP rank and dp 0."""
    k = topology.coordinates(rank)
    tp_rank = k.atp if topology.dp > 1 else rank % topology.tp
    return {"rank": str(rank), "tp_rank": str(tp_rank), "pp_rank": str(k.pp), "dp_rank": str(k.dp),
            "cp_rank": str(k.cp)}


def _buckets(bounds: tuple[float, ...], counts: Sequence[int]) -> list[tuple[str, float]]:
    """Cumulative buckets from per-bucket counts (the last one: above every bound)."""
    out: list[tuple[str, float]] = []
    running = 0
    for bound, count in zip(bounds, counts):
        running += count
        out.append((repr(float(bound)), running))
    out.append(("+Inf", running + counts[-1]))
    return out


def _method_of(path: str) -> tuple[str, str]:
    """(service, method) of a call path, or ("unknown", "unknown") for a
    method no registered service declares: call paths come from clients,
    and labels must not grow with whatever names a client makes up."""
    service, _, method = path.lstrip("/").partition("/")
    try:
        descriptor_pool.Default().FindServiceByName(service).methods_by_name[method]
    except KeyError:
        return "unknown", "unknown"
    return service, method


class RpcMetrics(grpc.aio.ServerInterceptor):
    """Counts and times every call the server handles, by service, method,
    type and status code. Runs on the event loop; read by `snapshot`."""

    def __init__(self) -> None:
        self.started: Counter[tuple[str, str, str]] = Counter()
        self.handled: Counter[tuple[str, str, str, str]] = Counter()
        self.latency: dict[tuple[str, str, str], Histogram] = {}

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:  # no such method: gRPC answers UNIMPLEMENTED itself
            return handler
        service, method = _method_of(handler_call_details.method or "")
        for attr, kind in (("unary_unary", "unary"), ("unary_stream", "server_stream"),
                           ("stream_unary", "client_stream"), ("stream_stream", "bidi_stream")):
            behavior = getattr(handler, attr)
            if behavior is not None:
                return handler._replace(**{attr: self._wrap(behavior, (service, method, kind))})
        return handler

    @contextlib.contextmanager
    def _measured(self, key: tuple[str, str, str], context: grpc.aio.ServicerContext) -> Iterator[None]:
        start, code = self._start(key), "OK"
        try:
            yield
        except BaseException as exc:
            code = _code_of(exc, context)
            raise
        else:
            code = _code_set(context)
        finally:
            self._end(key, code, start)

    def _wrap(self, behavior: Callable[..., Any], key: tuple[str, str, str]) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behavior):
            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                with self._measured(key, context):
                    async for item in behavior(request, context):
                        yield item
            return stream
        if not inspect.iscoroutinefunction(behavior):
            return behavior  # every handler of this daemon is async; a sync one is left as it is

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with self._measured(key, context):
                return await behavior(request, context)
        return call

    def _start(self, key: tuple[str, str, str]) -> float:
        self.started[key] += 1
        return time.perf_counter()

    def _end(self, key: tuple[str, str, str], code: str, start: float) -> None:
        self.handled[(*key, code)] += 1
        self.latency.setdefault(key, Histogram(RPC_BOUNDS_S)).observe(time.perf_counter() - start)

    def snapshot(self) -> tuple[dict[tuple[str, str, str], int], dict[tuple[str, str, str, str], int],
                                dict[tuple[str, str, str], tuple[list[int], float]]]:
        """Copies, taken on the loop."""
        return (dict(self.started), dict(self.handled),
                {key: (list(h.counts), h.total_s) for key, h in self.latency.items()})


def _code_set(context: grpc.aio.ServicerContext) -> str:
    code = context.code()
    return code.name if isinstance(code, grpc.StatusCode) else "OK"


def _code_of(exc: BaseException, context: grpc.aio.ServicerContext) -> str:
    if isinstance(exc, asyncio.CancelledError):
        return "CANCELLED"
    code = context.code()
    if isinstance(exc, grpc.aio.AbortError) and isinstance(code, grpc.StatusCode):
        return code.name
    return "UNKNOWN"


@dataclass(frozen=True)
class Snapshot:
    """Every daemon value a scrape shows, copied on the event loop."""

    rpcs: tuple[dict[tuple[str, str, str], int], dict[tuple[str, str, str, str], int],
                dict[tuple[str, str, str], tuple[list[int], float]]]
    rank: RankStats
    handover: dict[str, int]  # `Daemon.handover_stats`: the pool handover's counters


class DaemonCollector:
    def __init__(self, daemon: Any) -> None:
        """`daemon`: the running `server.Daemon`. Its rank's stats and the
        pool handover's are read on its event loop only (`bind`), never from
        the metrics thread."""
        self._daemon = daemon
        config = daemon.config
        self.labels = rank_labels(config.topology, config.rank)
        self.rpc = RpcMetrics()
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Take snapshots on `loop` from now on (without one: on the caller's thread)."""
        self._loop = loop

    def snapshot(self) -> Snapshot:
        """Runs on the event loop."""
        return Snapshot(self.rpc.snapshot(), self._daemon.rank.stats(), self._daemon.handover_stats())

    def _snapshot_from_loop(self) -> Snapshot | None:
        loop = self._loop
        if loop is None:
            return self.snapshot()
        if loop.is_closed():
            return None
        result: concurrent.futures.Future[Snapshot] = concurrent.futures.Future()

        def take() -> None:
            try:
                result.set_result(self.snapshot())
            except BaseException as exc:  # handed to the scrape, which logs it
                result.set_exception(exc)

        try:
            loop.call_soon_threadsafe(take)
            return result.result(SNAPSHOT_TIMEOUT_S)
        except RuntimeError:  # the loop closed meanwhile
            return None
        except concurrent.futures.TimeoutError:
            log.warning("the event loop did not answer a scrape within %.0fs", SNAPSHOT_TIMEOUT_S)
            return None

    def collect(self) -> Iterator[Metric]:
        names, values = list(self.labels), list(self.labels.values())
        info = GaugeMetricFamily("cpcache_build_info", "cpcache build; the value is always 1",
                                 labels=["version", "python_version", "grpc_version"])
        info.add_metric([cpcache.__version__, platform.python_version(), grpc.__version__], 1)
        yield info
        snap = self._snapshot_from_loop()
        if snap is None:
            return
        yield from _rpc_families(*snap.rpcs)
        yield from _rank_families(snap.rank, names, values)
        yield from _handover_families(snap.handover, names, values)


def _rank_families(stats: RankStats, names: list[str], values: list[str]) -> Iterator[Metric]:
    if stats.engine is not None:
        e = stats.engine
        rounds = CounterMetricFamily("cpcache_rounds", "Agreement rounds completed", labels=names)
        rounds.add_metric(values, e.rounds)
        divergences = CounterMetricFamily("cpcache_divergences", "Rounds whose ranks disagreed", labels=names)
        divergences.add_metric(values, e.divergences)
        lost = GaugeMetricFamily("cpcache_peer_lost",
                                 "1 once the domain has lost a peer (decisions are refused until a restart)",
                                 labels=names)
        lost.add_metric(values, int(e.peer_lost))
        latency = HistogramMetricFamily("cpcache_round_duration_seconds",
                                        "Time a round spent in its collectives", labels=names)
        latency.add_metric(values, _buckets(ROUND_BOUNDS_S, e.round_latency.counts), e.round_latency.total_s)
        yield from (rounds, divergences, lost, latency)
    if stats.steps is not None:
        phase = HistogramMetricFamily(
            "cpcache_step_phase_seconds", "Time a step spent in each phase on this rank (the collective "
            "itself: cpcache_round_duration_seconds)", labels=names + ["phase"])
        for name, buckets in stats.steps.phases.items():
            phase.add_metric(values + [name], _buckets(PHASE_BOUNDS_S, buckets.counts), buckets.total_s)
        yield phase
        questions = GaugeMetricFamily("cpcache_open_questions", "Questions open in the agreement table",
                                      labels=names)
        questions.add_metric(values, stats.steps.open_questions)
        yield questions
    cache = stats.cache
    if cache is None:
        return
    hits = CounterMetricFamily("cpcache_hit_pages", "Pages served from a tier (agreed)", labels=names + ["tier"])
    for tier, n in sorted(cache.hits.items()):
        hits.add_metric(values + [tier], n)
    route = names + ["src", "dst"]
    pages = CounterMetricFamily("cpcache_moved_pages", "Pages moved from one tier to another", labels=route)
    moved = CounterMetricFamily("cpcache_moved_bytes", "Bytes moved from one tier to another", labels=route)
    errors = CounterMetricFamily("cpcache_transfer_failures", "Transfers that failed", labels=route)
    refused = CounterMetricFamily("cpcache_late_transfers_refused",
                                  "Transfers of an ended session refused before they touched anything "
                                  "(storage work; its copies issued before the end run)",
                                  labels=route)
    counters = cache.moved
    for (src, dst), n in sorted(counters["pages_moved"].items()):
        pages.add_metric(values + [src, dst], n)
        moved.add_metric(values + [src, dst], counters["bytes_moved"][(src, dst)])
        errors.add_metric(values + [src, dst], counters["failed_jobs"][(src, dst)])
        refused.add_metric(values + [src, dst], counters["refused_jobs"][(src, dst)])
    occupancy = GaugeMetricFamily("cpcache_host_pages", "Host pool pages by state", labels=names + ["state"])
    for name in ("used", "free", "retiring"):
        occupancy.add_metric(values + [name], cache.state[f"host_pages_{name}"])
    held = GaugeMetricFamily("cpcache_prefetch_held_pages",
                             "Host pages that ended prefetches keep for their request's load", labels=names)
    held.add_metric(values, cache.state["prefetch_held_pages"])
    expired = CounterMetricFamily("cpcache_prefetch_holds_expired",
                                  "Prefetch holds that ran out of steps before the scheduler released them",
                                  labels=names)
    expired.add_metric(values, cache.state["prefetch_holds_expired"])
    unloaded = CounterMetricFamily("cpcache_prefetched_pages_evicted_unloaded",
                                   "Prefetched pages evicted before any load read them (storage reads wasted)",
                                   labels=names)
    unloaded.add_metric(values, cache.state["prefetched_pages_evicted_unloaded"])
    evicted = CounterMetricFamily("cpcache_host_pages_evicted", "Pages evicted from the host pool to make room",
                                  labels=names)
    evicted.add_metric(values, cache.state["host_pages_evicted"])
    yield from (hits, pages, moved, errors, refused, occupancy, held, expired, unloaded, evicted)
    yield from _lost_hit_families(cache.state, names, values)


LOST_PREFIX = "lost_hit_pages_"


def _lost_hit_families(state: dict[str, int], names: list[str], values: list[str]) -> Iterator[Metric]:
    """Where the pages prefetches asked for went (docs/operations.md, "Why a
    hit was lost"): asked = storage hits + found resident + every reason but
    host_evicted, which takes pages after they entered (a part of the hits)."""
    asked = CounterMetricFamily("cpcache_prefetch_asked_pages",
                                "Pages past the host pool that prefetches asked storage for", labels=names)
    asked.add_metric(values, state["prefetch_asked_pages"])
    resident = CounterMetricFamily("cpcache_prefetch_resident_pages",
                                   "Pages a prefetch read that another operation had brought meanwhile",
                                   labels=names)
    resident.add_metric(values, state["prefetch_resident_pages"])
    lost = CounterMetricFamily(
        "cpcache_lost_hit_pages", "Pages a request could have hit below the device and did not, by reason: "
        "storage_miss, below_threshold, host_full, revoked, prefetch_late, read_failed, host_evicted",
        labels=names + ["reason"])
    for key in sorted(k for k in state if k.startswith(LOST_PREFIX)):
        lost.add_metric(values + [key.removeprefix(LOST_PREFIX)], state[key])
    short = CounterMetricFamily("cpcache_prefetches_short",
                                "Prefetches that ended before every page of their storage hit was read "
                                "(their request computed the rest; the reads went on, and were thrown away)",
                                labels=names)
    short.add_metric(values, state["prefetches_short"])
    yield from (asked, resident, lost, short)


def _handover_families(stats: dict[str, int], names: list[str], values: list[str]) -> Iterator[Metric]:
    """The `pool_handover_*` counters and `pool_tickets_held`, as the `Stats` RPC names them."""
    if not stats:
        return  # the handover has not started
    events = CounterMetricFamily("cpcache_pool_handover_events",
                                 "What the pool handover refused or waited out, by kind (docs/security.md)",
                                 labels=names + ["event"])
    for key, n in sorted(stats.items()):
        if key.startswith(HANDOVER_PREFIX):
            events.add_metric(values + [key.removeprefix(HANDOVER_PREFIX)], n)
    held = GaugeMetricFamily("cpcache_pool_tickets_held", "Pool tickets handed over and not yet taken by an Attach",
                             labels=names)
    held.add_metric(values, stats.get("pool_tickets_held", 0))
    yield from (events, held)


def _rpc_families(started: dict[tuple[str, str, str], int], handled: dict[tuple[str, str, str, str], int],
                  latency: dict[tuple[str, str, str], tuple[list[int], float]]) -> Iterator[Metric]:
    names = ["grpc_service", "grpc_method", "grpc_type"]
    started_family = CounterMetricFamily("grpc_server_started", "RPCs started on the server", labels=names)
    for (service, method, kind), n in sorted(started.items()):
        started_family.add_metric([service, method, kind], n)
    handled_family = CounterMetricFamily("grpc_server_handled", "RPCs completed on the server, by status code",
                                         labels=names + ["grpc_code"])
    for (service, method, kind, code), n in sorted(handled.items()):
        handled_family.add_metric([service, method, kind, code], n)
    seconds = HistogramMetricFamily("grpc_server_handling_seconds",
                                    "Time from the start of an RPC to its status, on the server", labels=names)
    for (service, method, kind), (counts, total_s) in sorted(latency.items()):
        seconds.add_metric([service, method, kind], _buckets(RPC_BOUNDS_S, counts), total_s)
    yield from (started_family, handled_family, seconds)


def registry_for(collector: DaemonCollector) -> CollectorRegistry:
    """The daemon's registry: its own collector plus the standard process_*
    and python_* ones (a custom registry starts without them)."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    registry.register(collector)
    return registry


async def serve(collector: DaemonCollector, address: str) -> MetricsServer:
    """Serve /metrics on host:port (port 0: any free port), on the daemon's
    event loop, which then answers the snapshots (`metrics_http`)."""
    host, port = split_host_port(address, "metrics_address")
    collector.bind(asyncio.get_running_loop())
    server = MetricsServer(registry_for(collector))
    server.port = await server.start(host or "127.0.0.1", port)
    return server
