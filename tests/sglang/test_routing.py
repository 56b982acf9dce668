"""A real gateway routing on what the tiers hold: two `sglang.launch_server
--smg-grpc-mode` servers (tp 1), each over its own `cpcache launch` domain,
one shared file store, behind Shepherd Model Gateway (`smg launch --policy
cache_aware`) subscribed to their KV events (`--kv-events-config`, relayed
by the servicer's `SubscribeKvEvents`).

Documents are each served once, by whichever server the gateway picks;
other documents then turn that server's device pool over, its host pool
keeping the document. Asked again, each document goes to the server whose
host pool holds it (a host hit there, counted by its daemon) and not to the
other (which would read it from the shared store: a storage hit there).
The gateway knows where only from the host pool's `CPU_PINNED` events: the
device tree has published the pages' removal."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from cpcache.testing.sglang_cpu.gateway import INDEX_ONLY, Fleet, Gateway, smg_installed
from cpcache.testing.sglang_cpu.servers import SGLANG_PYTHON, make_tiny_model
from cpcache.tools.bench.serving import add_tokenizer

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(480),
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason=f"SGLang's environment is not built ({SGLANG_PYTHON}); "
                       "`make setup` builds it"),
    pytest.mark.skipif(SGLANG_PYTHON.exists() and not smg_installed(),
                       reason="Shepherd Model Gateway (smg) is not installed in SGLang's environment: `make setup`"),
]

PAGE = 16
DEVICE_TOKENS = 512  # 32 pages per server
DOC = 160  # 10 pages
CHECKED = 3  # documents asked again
FILLERS = 24  # at most: documents sent until each checked document's server has turned its device pool over


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, Gateway]]:
    work = tmp_path_factory.mktemp("routing")
    model = add_tokenizer(make_tiny_model(work / "qwen3", "qwen3"))
    servers = Fleet(work, model, events=True, device_tokens=DEVICE_TOKENS, host_pages=256, page_size=PAGE)
    try:
        servers.start()
        gateway = Gateway(work, model, servers.urls(), "cache_aware", flags=INDEX_ONLY)
        try:
            yield servers, gateway.start()
        finally:
            gateway.stop()
    finally:
        servers.stop()


def entered(servers: Fleet) -> list[int]:
    """Pages each server's host pool has taken in so far."""
    return [c["host_pages_used"] + c["host_pages_evicted"] for c in servers.counters()]


def hits(servers: Fleet) -> list[tuple[int, int]]:
    return [(c["host_hit_pages"], c["storage_hit_pages"]) for c in servers.counters()]


def test_a_prefix_off_the_device_goes_to_the_server_whose_host_pool_holds_it(fleet: tuple[Fleet, Gateway]):
    servers, gateway = fleet
    rng = random.Random(7)
    docs = [[rng.randrange(1, 500) for _ in range(DOC)] for _ in range(CHECKED + FILLERS)]

    holders = []
    for doc in docs[:CHECKED]:
        before = entered(servers)
        gateway.generate(doc + [1])
        grew = [i for i, (a, b) in enumerate(zip(entered(servers), before)) if a > b]
        assert len(grew) == 1, f"one server should have served the document: host pools grew on {grew}"
        holders.append((grew[0], entered(servers)[grew[0]]))

    # Other documents until every holder has taken in more than its device
    # pool since its document: that document's device copy is gone (LRU).
    fillers = iter(docs[CHECKED:])
    while any(entered(servers)[h] - at <= DEVICE_TOKENS // PAGE for h, at in holders):
        doc = next(fillers, None)
        assert doc is not None, f"{FILLERS} documents did not turn the device pools over: {entered(servers)}"
        gateway.generate(doc + [1])

    for doc, (holder, _) in zip(docs[:CHECKED], holders):
        before = hits(servers)
        reply = gateway.generate(doc + [2])
        after = hits(servers)
        host = [a[0] - b[0] for a, b in zip(after, before)]
        storage = [a[1] - b[1] for a, b in zip(after, before)]
        assert host[holder] == DOC // PAGE and sum(storage) == 0 and sum(host) == host[holder], \
            f"document served by server {holder}: host hits {host}, storage hits {storage}"
        assert reply["meta_info"]["cached_tokens"] == DOC
