"""The metrics endpoint formats at most once a
second whatever the scrape rate, and one address holds at most
METRICS_PER_SOURCE of its connections. In process; every wait is bounded."""

import asyncio

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from cpcache.daemon import budget
from cpcache.daemon.metrics_http import MetricsServer

pytestmark = pytest.mark.timeout(30)


class Counting:
    """A collector that counts how often it is formatted."""

    def __init__(self) -> None:
        self.collected = 0

    def collect(self):
        self.collected += 1
        yield GaugeMetricFamily("cpcache_test_collected", "formattings so far", value=self.collected)


@pytest.fixture
async def served():
    registry, counting = CollectorRegistry(), Counting()
    registry.register(counting)
    server = MetricsServer(registry)
    port = await server.start("127.0.0.1", 0)
    yield server, port, counting
    await server.close()


async def scrape(port: int, source: str = "127.0.0.1") -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return answer


async def test_scrapes_within_a_second_share_one_formatting(served):
    server, port, counting = served
    answers = await asyncio.gather(*(scrape(port, f"127.0.0.{10 + i}") for i in range(5)))
    answers += [await scrape(port) for _ in range(5)]
    assert all(a.startswith(b"HTTP/1.1 200") for a in answers)
    assert counting.collected <= 2  # once, or twice if the second crossed the cache's age
    assert len(set(answers)) <= 2


async def test_a_formatting_is_redone_once_the_cache_is_old(served, monkeypatch):
    server, port, counting = served
    monkeypatch.setattr(budget, "METRICS_CACHE_S", 0.0)
    for _ in range(3):
        assert (await scrape(port)).startswith(b"HTTP/1.1 200")
    assert counting.collected == 3


async def test_one_address_holds_at_most_its_share(served):
    server, port, _ = served
    idle = [await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
            for _ in range(budget.METRICS_PER_SOURCE + 1)]
    # The third from that address closed its oldest idle one.
    assert await asyncio.wait_for(idle[0][0].read(), 5) == b""
    assert (await scrape(port, "127.0.0.3")).startswith(b"HTTP/1.1 200")  # another address is served
    assert server.refused == 1  # and took nothing from 127.0.0.2's others
    for _, writer in idle:
        writer.close()
