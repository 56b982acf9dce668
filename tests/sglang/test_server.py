"""SGLang serves with cpcache: real `python -m sglang.launch_server` servers
(spawned schedulers, HTTP /generate) at tp 2 on the CPU, a tiny random Llama
made here, over `cpcache launch` daemons with file storage.

Copies between the device and the host pools are slowed on every rank
independently (fault injection), so steps overlap I/O and ranks end it at
different times. A workload whose prefixes leave the device pool and come
back (a shared
system prompt, documents that overflow the device pool and, with a small
host pool, the host pool too) is sent to a cpcache server and to a
`--disable-radix-cache` server; every reply must match, token for token and
logprob for logprob. A page planted in storage (a valid frame around wrong
bytes) must break that match: the check sees wrong KV. Then the cache is
flushed while writes are queued, and a daemon is killed mid-run: the server
keeps answering correctly, both ranks leave the daemon at the same
iteration, and come back to it at the same iteration once the launcher has
restarted it.

Runs alone with `make test-sglang` (or `pytest -m sglang tests/sglang`).
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from cpcache.dataplane.storage import framing
from cpcache.keys import chain, generation_seed
from cpcache.tools.sglang_cpu.servers import (
    CPCACHE_FLAGS,
    PLAIN_FLAGS,
    SGLANG_PYTHON,
    Daemons,
    Reply,
    Server,
    make_tiny_model,
    same_outputs,
)

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason=f"SGLang's environment is not built ({SGLANG_PYTHON}); "
                       "`make setup` builds it"),
]

TP = 2
PAGE = 16
DEVICE_TOKENS = 1024  # 64 pages: about three documents
HOST_PAGES = 128  # twice the device pool, as HiCache's default: about seven documents
SYSTEM = 64
DOC = 256
DOCS = 10  # more than the host pool holds: the first ones live in storage only


def workload(seed: int = 1, docs: int = DOCS) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    system = [rng.randrange(1, 500) for _ in range(SYSTEM)]
    return system, [[rng.randrange(1, 500) for _ in range(DOC)] for _ in range(docs)]


def prompt(system: list[int], doc: list[int], turn: int, question: int) -> list[int]:
    return system + doc + [turn + 1, question + 1]


class Stack:
    def __init__(self, work: Path, model: Path) -> None:
        self.work = work
        self.storage = work / "pages"
        self.daemons = Daemons(work / "run", tp=TP, settings=dict(
            storage="file", storage_root=str(self.storage), host_pool_pages=HOST_PAGES,
            prefetch_threshold_tokens=0, prefetch_policy="wait_complete",
            # Every device <-> host copy takes uniform(0, 400) ms, on each rank
            # independently: steps overlap I/O and ranks finish it apart.
            fault_copy_delay_ms=400.0,
            # Every storage call takes uniform(0, 200) ms: prefetches are
            # still open when their request is aborted.
            fault_storage_delay_ms=200.0))
        config = work / "sglang-cpcache.json"
        config.write_text(json.dumps({"socket": str(work / "run" / "rank-{rank}.sock"), "model_id": "tiny",
                                      "reattach_after_iterations": 32}))
        self.model = model
        # --enable-metrics: SGLang's HiCache gauges read the backend's host pool.
        self.cpcache = Server("cpcache", model, work, [*CPCACHE_FLAGS, "--enable-metrics"], tp=TP, page_size=PAGE,
                              device_tokens=DEVICE_TOKENS, env={"CPCACHE_SGLANG_CONFIG": str(config)})
        self.plain = Server("plain", model, work, PLAIN_FLAGS, tp=TP, page_size=PAGE, device_tokens=DEVICE_TOKENS)
        self.expected: dict[tuple[int, ...], Reply] = {}

    def start(self) -> Stack:
        self.daemons.start()
        self.plain.start()
        self.cpcache.start()
        self.plain.wait_ready()
        self.cpcache.wait_ready()
        return self

    def stop(self) -> None:
        self.cpcache.stop()
        self.plain.stop()
        self.daemons.stop()

    def reference(self, ids: list[int]) -> Reply:
        key = tuple(ids)
        if key not in self.expected:
            self.expected[key] = self.plain.generate(ids)
        return self.expected[key]

    def check(self, ids: list[int]) -> Reply:
        """cpcache's reply, asserted equal to the plain server's."""
        got = self.cpcache.generate(ids)
        want = self.reference(ids)
        assert same_outputs(got, want), f"cpcache answered {got}, a server without cache {want}"
        return got


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("sglang")
    model = make_tiny_model(work / "tiny-llama")
    started = time.monotonic()
    stack = Stack(work, model)
    try:
        stack.start()
        print(f"servers ready in {time.monotonic() - started:.1f} s")
        yield stack
    finally:
        stack.stop()


def test_outputs_equal_a_server_without_cache_and_hits_come_from_every_tier(stack: Stack):
    system, docs = workload()
    replies = [stack.check(prompt(system, doc, 0, d)) for d, doc in enumerate(docs)]
    # Back in reverse: the latest documents are still on the device, the
    # ones before them in the host pool, the first ones in storage only.
    second = [stack.check(prompt(system, docs[d], 1, d)) for d in reversed(range(len(docs)))]
    replies += second
    assert sum(r.device for r in replies) > 0, "no device hit"
    assert sum(r.host for r in second) > 0, f"no host hit: {second}"
    assert sum(r.storage for r in second) > 0, f"no storage hit: {second}"
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{stack.cpcache.port}/metrics", timeout=30).read().decode()
    assert "hicache_host_total_tokens" in metrics, "SGLang's host-pool gauges are missing"
    hit = sum(r.cached for r in replies) / sum(len(prompt(system, d, 0, 0)) for d in docs * 2)
    print(f"hit rate {hit:.3f}; second pass device/host/storage tokens "
          f"{sum(r.device for r in second)}/{sum(r.host for r in second)}/{sum(r.storage for r in second)}")


def test_flush_cache_while_writes_are_queued_serves_no_wrong_bytes(stack: Stack):
    system, docs = workload(seed=2, docs=3)
    for d, doc in enumerate(docs):
        ids = prompt(system, doc, 0, d)
        answer: list[Reply] = []
        server = stack.cpcache.process
        assert server is not None
        prefills = len(server.lines_with("Prefill batch"))
        worker = threading.Thread(target=lambda ids=ids, answer=answer: answer.append(stack.cpcache.generate(ids)))
        worker.start()
        server.wait_lines("Prefill batch", prefills + 1, timeout_s=120)  # the request runs
        # Taken at the first iteration the request is not running: its
        # write-through was queued at its end, and is queued or in flight now.
        stack.cpcache.flush_cache()
        worker.join(120)
        assert answer, "the request did not finish"
        assert same_outputs(answer[0], stack.reference(ids))
    flushes = stack.cpcache.log_lines("flushed its cache")
    assert len(flushes) == TP * len(docs), flushes
    caught = [line for line in flushes if "0 queued writes cancelled, 0 in flight" not in line]
    assert caught, f"no flush found a write queued or in flight: {flushes}"
    # A flush leaves nothing reachable below the device either (as SGLang's
    # HiCache empties its host pool): the same documents are computed again.
    for d, doc in enumerate(docs):
        again = stack.check(prompt(system, doc, 1, d))
        assert again.host == 0 and again.storage == 0, again


def test_a_weight_update_leaves_no_page_of_the_old_weights_reachable(stack: Stack):
    system, docs = workload(seed=6, docs=2)
    for d, doc in enumerate(docs):
        stack.check(prompt(system, doc, 0, d))
    updated = stack.cpcache.post("/update_weights_from_disk", {"model_path": str(stack.model)})
    assert updated.get("success"), updated
    for d, doc in enumerate(docs):
        got = stack.check(prompt(system, doc, 1, d))
        assert got.host == 0 and got.storage == 0, f"pages of the old weights were served: {got}"


def stored_pages(stack: Stack, tokens: list[int]) -> list[Path]:
    # Every flush (a weight update's too) seeds the page chains anew.
    generation = len(stack.cpcache.log_lines("cpcache: rank 0 flushed its cache"))
    hashes = chain(tokens, PAGE, generation_seed(None, generation))
    return sorted(p for h in hashes for p in stack.storage.glob(f"*/*.{h}_*"))


def plant_wrong_page(path: Path) -> None:
    """Rewrite a stored page with other KV in a valid frame (checksum and
    all): what anyone who may write the storage root could do."""
    raw = path.read_bytes()
    header, payload = raw[: framing.HEADER.size], raw[framing.HEADER.size :]
    _, _, _, geometry, _, _ = framing.HEADER.unpack(header)
    wrong = (np.frombuffer(payload, dtype=np.float32) * -8.0 + 3.0).astype(np.float32).tobytes()
    path.write_bytes(framing.pack_header(geometry, wrong) + wrong)


def test_a_wrong_page_from_storage_breaks_the_match_negative_control(stack: Stack):
    system, docs = workload(seed=4)
    for d, doc in enumerate(docs):
        stack.check(prompt(system, doc, 0, d))
    target = docs[0]  # evicted from the device and the host pool since, kept in storage
    files = stored_pages(stack, system + target)
    assert files, "the document's pages are not in storage"
    for path in files[len(files) // 2 :]:
        plant_wrong_page(path)
    ids = prompt(system, target, 5, 0)
    got = stack.cpcache.generate(ids)
    assert got.storage > 0, f"the document did not come from storage: {got}"
    assert not same_outputs(got, stack.reference(ids)), "wrong KV served and the check did not see it"


def test_requests_aborted_during_their_prefetch_are_revoked_on_every_rank(stack: Stack):
    system, docs = workload(seed=5)
    for d, doc in enumerate(docs):
        stack.check(prompt(system, doc, 0, d))
    server = stack.cpcache.process
    assert server is not None
    for d in (0, 1):  # in storage only by now: each request starts a prefetch
        rid = f"aborted-{d}"
        answer: list[Reply] = []
        ids = prompt(system, docs[d], 1, d)
        worker = threading.Thread(target=lambda ids=ids, rid=rid, answer=answer: answer.append(
            stack.cpcache.generate(ids, rid=rid)))
        worker.start()
        for _ in range(10_000):  # until SGLang has the request: an abort of an unknown rid does nothing
            stack.cpcache.post("/abort_request", {"rid": rid})
            if server.lines_with(f"revoked the prefetch of aborted request {rid}") or not worker.is_alive():
                break
        worker.join(120)
        assert answer and answer[0].finish == "abort", answer
        server.wait_lines(f"revoked the prefetch of aborted request {rid}", TP, timeout_s=60)
    # The revoked prefetches left nothing wrong behind: the same documents again.
    for d in (0, 1, 2):
        stack.check(prompt(system, docs[d], 2, d))


def test_a_killed_daemon_falls_back_on_every_rank_at_one_iteration_and_comes_back(stack: Stack):
    system, docs = workload(seed=3, docs=4)
    requests = [prompt(system, doc, t, d) for t in range(3) for d, doc in enumerate(docs)]
    server = stack.cpcache.process
    assert server is not None
    for ids in requests[:2]:
        stack.check(ids)
    os.kill(stack.daemons.daemon_pid(1), signal.SIGKILL)
    for ids in requests[2:8]:  # served while rank 1's daemon is dead: device only, still correct
        stack.check(ids)
    fell = server.wait_lines("fell back to the device tree at iteration", TP, timeout_s=120)
    iterations = {line.split("at iteration ")[1].split(":")[0] for line in fell}
    assert len(iterations) == 1, f"the ranks fell back at different iterations: {fell}"
    back = server.wait_lines("attached again at iteration", TP, timeout_s=300)
    again = {line.split("at iteration ")[1].split(";")[0] for line in back}
    assert len(again) == 1, f"the ranks attached again at different iterations: {back}"
    replies = [stack.check(ids) for ids in requests[8:]]
    assert sum(r.host + r.storage for r in replies) > 0, f"no host or storage hit after attaching again: {replies}"
