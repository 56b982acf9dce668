"""A gateway's view of every tier: a real `sglang.launch_server` at tp 2 over
`cpcache launch` daemons with file storage, publishing KV events with
`--kv-events-config` (ZMQ on a loopback port, the one switch), and a
subscriber (events_subscriber.py, in SGLang's environment) decoding the
stream with SGLang's own `KVEventBatch`.

A conversation's pages move down the tiers: written through to the host
pool (CPU_PINNED stored, under the very block hashes the device tree
publishes), backed up to file storage (DISK stored), evicted from the host
pool (CPU_PINNED removed: as many pages as the daemon's own
`host_pages_evicted` counter says), found gone from storage by a lookup
(DISK removed), and cleared by /flush_cache (SGLang's AllBlocksCleared).
One publisher: attention TP rank 0's scheduler; its peer queues nothing."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cpcache.client import Client
from cpcache.testing.ports import free_port
from cpcache.testing.sglang_cpu.servers import SGLANG_PYTHON, Watched
from cpcache.testing.sglang_cpu.stacks import Shape, Stack, prompt, started, workload
from tests.sglang.stacks import References

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(420),
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason=f"SGLang's environment is not built ({SGLANG_PYTHON}); "
                       "`make setup` builds it"),
]

SHAPE = Shape("llama", tp=2)
ROOT = Path(__file__).resolve().parents[2]
SUBSCRIBER = Path(__file__).resolve().parent / "events_subscriber.py"


class Stream:
    """The subscriber's decoded events, as they arrive."""

    def __init__(self, process: Watched) -> None:
        self.process = process

    def events(self) -> list[dict]:
        return [json.loads(line.split(" ", 1)[1]) for line in self.process.lines_with("event {")]

    def pages(self, kind: str, medium: str | None = None) -> list[int]:
        return [h for e in self.events() if e["type"] == kind and (medium is None or e["medium"] == medium)
                for h in e["hashes"]]

    def wait(self, what: str, condition: Callable[[], bool], timeout_s: float = 120.0) -> None:
        """Until `condition` holds, woken by each event line (and once a
        second, for conditions on the daemons' counters)."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            left = deadline - time.monotonic()
            assert left > 0 and not self.process.exited.is_set(), \
                f"{what}: not within {timeout_s:g} s; the stream so far:\n{self.process.tail(40)}"
            with self.process.new_line:
                self.process.new_line.wait(min(left, 1.0))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, references: References):
    work = tmp_path_factory.mktemp("kv-events")
    model = references.model(SHAPE.family)  # the session's, made once
    port, replay = free_port(), free_port()
    config = json.dumps({"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}", "bind": True,
                         "replay_endpoint": f"tcp://127.0.0.1:{replay}", "topic": "kv-events"})
    subscriber = Watched([str(SGLANG_PYTHON), str(SUBSCRIBER), f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}"],
                         work / "subscriber.log", ["subscribed"], env={"PYTHONPATH": str(ROOT)})
    try:
        # No reference server (outputs are test_server.py's), short I/O delays: one server set, quickly.
        with started(work, model, SHAPE, with_reference=False, copy_delay_ms=20.0, storage_delay_ms=10.0,
                     server_flags=["--kv-events-config", config]) as stack:
            subscriber.wait_for("subscribed", 120)
            yield stack, Stream(subscriber)
    finally:
        subscriber.stop()


def host_counters(stack: Stack) -> dict[str, int]:
    with Client(stack.daemons.socket(0), timeout_s=10) as daemon:
        stats = dict(daemon.stats())
    return {"evicted": stats["host_pages_evicted"], "used": stats["host_pages_used"]}


def test_a_conversation_moving_down_the_tiers_is_published_tier_by_tier(served: tuple[Stack, Stream]):
    stack, stream = served
    system, docs = workload(seed=5)
    for d, doc in enumerate(docs):  # more than the host pool holds: it evicts
        stack.generate(prompt(system, doc, 0, d))
    stack.generate(prompt(system, docs[-1], 1, 0))  # its steps report the last backups

    # The host pool, as the daemons count it: every page evicted was published
    # removed, and what was stored and not removed is what the pool holds.
    seen: dict[str, int] = {}

    def host_pool_published() -> bool:
        seen.update(host_counters(stack))
        stored, removed = stream.pages("BlockStored", "CPU_PINNED"), stream.pages("BlockRemoved", "CPU_PINNED")
        seen.update(stored=len(stored), removed=len(removed))
        return seen["evicted"] > 0 and len(removed) == seen["evicted"] and len(stored) - len(removed) == seen["used"]

    stream.wait(f"the host pool's events (last seen {seen})", host_pool_published)

    device = set(stream.pages("BlockStored", "GPU"))
    host = set(stream.pages("BlockStored", "CPU_PINNED"))
    disk = set(stream.pages("BlockStored", "DISK"))
    assert device, "the device tree published nothing: its own events must be unchanged"
    assert host <= device, "host pages published under other hashes than the device tree's"
    assert disk and disk <= host, f"{len(disk)} pages stored, {len(disk - host)} never in the host pool"
    assert not stream.pages("BlockStored", "EXTERNAL")

    # Storage loses every page (as a capacity eviction or a damaged page's
    # deletion would): the next lookup of the first document finds it gone.
    for page in [p for p in stack.storage.rglob("*") if p.is_file()]:
        page.unlink()
    stack.generate(prompt(system, docs[0], 1, 0))
    stream.wait("a storage removal", lambda: bool(stream.pages("BlockRemoved", "DISK")))
    assert set(stream.pages("BlockRemoved", "DISK")) <= disk

    before = len(stream.events())
    stack.cpcache.flush_cache()
    stream.wait("AllBlocksCleared", lambda: any(e["type"] == "AllBlocksCleared" for e in stream.events()[before:]))

    assert {e["dp_rank"] for e in stream.events()} == {0}
    tiers = stack.cpcache.log_lines("KV events of the tiers below")
    assert [line for line in tiers if "rank 0 " in line] and not [line for line in tiers if "rank 1 " in line], tiers
    print(f"published: {len(device)} device, {len(host)} host, {len(disk)} storage pages; host pool {seen}")
