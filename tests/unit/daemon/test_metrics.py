"""The pool handover's counters reach Prometheus as they reach the `Stats`
RPC: both read `Daemon.handover_stats`. In process; no daemon is started."""

import pytest

from cpcache.config import DaemonConfig
from cpcache.daemon import server
from cpcache.daemon.call_limits import CallCounts
from cpcache.daemon.metrics import DaemonCollector
from cpcache.daemon.pool_handover import PoolHandover
from cpcache.rank.stats import RankStats

pytestmark = pytest.mark.timeout(30)


class Rank:
    def stats(self) -> RankStats:
        return RankStats()


class Daemon:
    """The parts of `server.Daemon` that the `Stats` RPC and a scrape read."""

    config = DaemonConfig(rank=0)
    rank = Rank()
    calls = CallCounts()
    handover_stats = server.Daemon.handover_stats
    stats = server.Daemon.stats

    def __init__(self, pools: PoolHandover | None) -> None:
        self._pools = pools


def samples(daemon: Daemon) -> dict[tuple[str, str | None], float]:
    return {(s.name, s.labels.get("event")): s.value for m in DaemonCollector(daemon).collect() for s in m.samples}


def test_the_pool_handovers_counters_are_scraped_as_stats_counts_them(tmp_path):
    handover = PoolHandover(str(tmp_path / "rank-0.sock.pools"))  # not started: its counters only
    handover.counters.update(refused_tickets=3, expired=1)
    daemon = Daemon(handover)
    scraped, counted = samples(daemon), daemon.stats()
    assert scraped["cpcache_pool_handover_events_total", "refused_tickets"] == counted[
        "pool_handover_refused_tickets"] == 3
    assert scraped["cpcache_pool_handover_events_total", "expired"] == counted["pool_handover_expired"] == 1
    assert scraped["cpcache_pool_tickets_held", None] == counted["pool_tickets_held"] == 0


def test_no_handover_series_before_the_handover_starts():
    scraped = samples(Daemon(None))
    assert not any(name.startswith("cpcache_pool_") for name, _ in scraped)
    assert ("cpcache_build_info", None) in scraped
