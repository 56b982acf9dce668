"""Prometheus metrics on an optional HTTP port. Values are read from the
daemon at scrape time (the core keeps plain counters); RPC counts by method
and status are counted here, at the gRPC edge."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from cpcache.agreement.engine import LatencyHistogram
from cpcache.values import split_host_port


class DaemonCollector:
    def __init__(self, daemon: Any) -> None:
        """`daemon`: the running `server.Daemon` (read from the metrics thread)."""
        self._daemon = daemon
        self.rpcs: collections.Counter[tuple[str, str]] = collections.Counter()

    def collect(self) -> Iterator[Metric]:
        d = self._daemon
        engine, coordinator = d.engine, d.coordinator
        labels = [str(d.config.rank)]
        rpcs = CounterMetricFamily("cpcache_rpcs", "RPCs answered, by method and status",
                                   labels=["rank", "method", "code"])
        for (method, code), n in sorted(self.rpcs.items()):
            rpcs.add_metric(labels + [method, code], n)
        yield rpcs
        if engine is None:
            return
        rounds = CounterMetricFamily("cpcache_rounds", "Agreement rounds completed", labels=["rank"])
        rounds.add_metric(labels, engine.rounds_completed)
        yield rounds
        divergences = CounterMetricFamily("cpcache_divergences", "Rounds whose ranks disagreed", labels=["rank"])
        divergences.add_metric(labels, engine.divergences)
        yield divergences
        lost = CounterMetricFamily("cpcache_peer_failures", "Rounds that lost a peer", labels=["rank"])
        lost.add_metric(labels, int(engine.failure is not None))
        yield lost
        hist = engine.round_latency
        buckets, running = [], 0
        for bound, count in zip(LatencyHistogram.BOUNDS_S, hist.counts):
            running += count
            buckets.append((str(bound), running))
        buckets.append(("+Inf", running + hist.counts[-1]))
        latency = HistogramMetricFamily("cpcache_round_seconds", "Time a round spent in its collectives",
                                        labels=["rank"])
        latency.add_metric(labels, buckets, hist.total_s)
        yield latency
        if coordinator is None:
            return
        questions = GaugeMetricFamily("cpcache_open_questions", "Questions open in the agreement table",
                                      labels=["rank"])
        questions.add_metric(labels, coordinator.open_questions)
        yield questions
        if coordinator.cache is None:
            return
        state, transfers = coordinator.cache.state, coordinator.cache.io.transfers
        hits = CounterMetricFamily("cpcache_hit_pages", "Pages served from a tier (agreed)", labels=["rank", "tier"])
        for tier, n in dict(state.hit_pages).items():
            hits.add_metric(labels + [tier], n)
        yield hits
        pages = CounterMetricFamily("cpcache_pages_moved", "Pages moved, by mover", labels=["rank", "mover"])
        moved = CounterMetricFamily("cpcache_bytes_moved", "Bytes moved, by mover", labels=["rank", "mover"])
        errors = CounterMetricFamily("cpcache_transfer_failures", "Transfers that failed (storage errors)",
                                     labels=["rank", "mover"])
        counters = transfers.counters()
        for (src, dst), n in counters["pages_moved"].items():
            mover = f"{src}->{dst}"
            pages.add_metric(labels + [mover], n)
            moved.add_metric(labels + [mover], counters["bytes_moved"][(src, dst)])
            errors.add_metric(labels + [mover], counters["failed_jobs"][(src, dst)])
        yield from (pages, moved, errors)
        occupancy = GaugeMetricFamily("cpcache_host_pages", "Host pool pages by state", labels=["rank", "state"])
        stats = state.stats()
        for name in ("used", "free", "retiring"):
            occupancy.add_metric(labels + [name], stats[f"host_pages_{name}"])
        yield occupancy


def serve(collector: DaemonCollector, address: str) -> int:
    """Serve /metrics on host:port (port 0: any free port); returns the port."""
    host, port = split_host_port(address, "metrics_address")
    registry = CollectorRegistry()
    registry.register(collector)
    server, _ = start_http_server(port, addr=host or "127.0.0.1", registry=registry)
    return server.server_address[1]
