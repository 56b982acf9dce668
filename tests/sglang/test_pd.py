"""SGLang's prefill/decode disaggregation on the CPU: a prefill server and a
decode server (`python -m sglang.launch_server --disaggregation-mode ...`,
Mooncake's transfer engine over TCP on loopback) behind SGLang's router
(cpcache/testing/sglang_cpu/pd.py), with a tiny random Qwen3.

Every reply must equal, token for token and logprob for logprob, a
`--disable-radix-cache` tp 1 server's without disaggregation (the
session's, of the same seeded model). One deployment at a time (the
suite runs the one on files; CPCACHE_SGLANG_MORE=1 every one):

- a plain pair (prefill tp 1 with SGLang's radix cache);
- the seed's shape: a prefill server at tp 2 and attention CP 2 over cpcache
  daemons (host tier and storage: files, then Mooncake Store), the decode
  server offloading the pages it generates into the same store
  (`storage.CpcacheStore`). A multi-turn workload (documents that overflow
  the prefill's device pool, asked about again in reverse) hits the device,
  the host pool and storage, reported through the router; the next turn of
  a conversation finds the previous answer in storage; both prefill ranks
  take the same decisions; a prefill daemon killed mid-run costs the tiers,
  not the pair (Mooncake Store).

Runs alone with `pytest -m sglang tests/sglang/test_pd.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cpcache.client import Client
from cpcache.config import CacheConfig
from cpcache.dataplane.storage import StorageBackend
from cpcache.dataplane.storage.file import FileBackend
from cpcache.domain_file import domain_config
from cpcache.keys import chain, generation_pages
from cpcache.testing.mooncake_master import MooncakeMaster
from cpcache.testing.sglang_cpu.pd import PdDeployment, over_cpcache
from cpcache.testing.sglang_cpu.servers import (
    SGLANG_PYTHON,
    Daemons,
    Reply,
    Server,
    same_outputs,
    sglang_interpreter,
)
from cpcache.testing.sglang_cpu.stacks import DEVICE_TOKENS, PAGE, SLOW_RANK, Shape, prompt, workload
from tests.sglang.stacks import References, kill_daemon_mid_run_and_come_back
from tests.support.budget import more

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason=f"SGLang's environment is not built ({SGLANG_PYTHON}); "
                       "`make setup` builds it"),
]

# The prefill server at tp 2, attention CP 2 over cpcache daemons, on file
# storage and on Mooncake Store (the seed's shape); the decode server
# offloads into the same store. Within the suite's budget: file storage
# (the docs' PD recipe on Mooncake Store, at the daemons' defaults, runs in
# tests/sglang/test_recipes.py); CPCACHE_SGLANG_MORE=1 adds Mooncake Store
# with slowed I/O, the daemons' defaults on files, and a plain pair (radix,
# no cpcache).
CPCACHE_PAIRS = ["cpcache-file", more("cpcache-mooncake", id="cpcache-mooncake")]
PLAIN_PAIRS = [more("plain", id="plain")]
DEFAULTS_PAIRS = [more("cpcache-file-defaults", id="cpcache-file-defaults")]
DECISION_LOG = re.compile(r"rank (\d+) decision log: (\d+ steps, digest \w+)")


def requests() -> list[list[int]]:
    """Every document once, then each again (another turn) in reverse: the
    latest are still on the prefill's device, the ones before them in
    cpcache's host pool, the first ones in storage only."""
    system, docs = workload(seed=5)
    order = [*range(len(docs)), *reversed(range(len(docs)))]
    return [prompt(system, docs[d], turn=int(i >= len(docs)), question=d) for i, d in enumerate(order)]


@pytest.fixture(scope="module")
def model(references: References) -> Path:
    found = subprocess.run([sglang_interpreter(), "-c", "import importlib.util as u, sys; "
                            "sys.exit(not (u.find_spec('sglang_router') and u.find_spec('mooncake')))"], timeout=60)
    if found.returncode != 0:
        pytest.skip(f"SGLang's environment ({SGLANG_PYTHON}) has no sglang-router or Mooncake transfer engine: "
                    "`make setup` installs them")
    return references.model("qwen3")


class Reference:
    """The session's tp 1 Qwen3 server without cache (tests/sglang/stacks.py
    References: it sleeps when idle), and its replies by prompt and length."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.replies: dict[tuple[tuple[int, ...], int], Reply] = {}

    def reply(self, ids: list[int], max_new_tokens: int = 4) -> Reply:
        key = (tuple(ids), max_new_tokens)
        if key not in self.replies:
            self.replies[key] = self.server.generate(ids, max_new_tokens)
        return self.replies[key]


@pytest.fixture(scope="module")
def reference(references: References, model: Path) -> Iterator[Reference]:
    with references.use(Shape("qwen3", tp=2, cp=2)) as shared:
        shared.server.wait_ready()
        yield Reference(shared.server)


@pytest.fixture(scope="module")
def pd(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model: Path,
       reference: Reference) -> Iterator[PdDeployment]:
    """One deployment at a time (module scope, one instance per parameter:
    pytest stops one before it starts the next)."""
    work = tmp_path_factory.mktemp(f"pd-{request.param}")
    options = dict(page_size=PAGE, device_tokens=DEVICE_TOKENS)
    with contextlib.ExitStack() as running:
        if request.param == "plain":
            deployment = PdDeployment(work, model, **options)
        elif request.param == "cpcache-file-defaults":
            # The docs' recipe as printed: the daemons' own prefetch settings, no faults.
            defaults = CacheConfig()
            deployment = over_cpcache(work, model, tp=2, cp=2, daemon_settings=dict(
                prefetch_policy=defaults.prefetch_policy, prefetch_threshold_tokens=defaults.prefetch_threshold_tokens,
                prefetch_best_effort_wait_s=defaults.prefetch_best_effort_wait_s), **options)
        else:
            storage = None
            if request.param.endswith("mooncake"):
                master = running.enter_context(MooncakeMaster(work / "mooncake-master.log"))
                storage = dict(storage="mooncake", storage_master=master.master,
                               storage_metadata_server=master.metadata_server, storage_segment_bytes=256 << 20)
            # As the SGLang suite's stacks: every copy and storage call slowed,
            # one rank twice as much, so operations are open when a daemon dies.
            deployment = over_cpcache(work, model, tp=2, cp=2, storage=storage,
                                      daemon_settings=dict(fault_copy_delay_ms=400.0, fault_storage_delay_ms=200.0),
                                      prefill_flags=["--enable-metrics", "--enable-metrics-for-all-schedulers"],
                                      **options)
            assert deployment.daemons is not None
            deployment.daemons.per_rank = {SLOW_RANK: dict(fault_copy_delay_ms=800.0, fault_storage_delay_ms=400.0)}
        running.callback(deployment.stop)
        deployment.start().wait_ready()
        memory = {name: f"{rss / 2**30:.2f} GiB" for name, rss in deployment.memory_bytes().items()}
        print(f"\nPD {request.param}: healthy after {deployment.ready_s} s; resident memory {memory}")
        yield deployment


def run_workload(pd: PdDeployment, reference: Reference) -> list[Reply]:
    replies = []
    for ids in requests():
        begun = time.monotonic()
        got = pd.generate(ids)
        want = reference.reply(ids)
        assert same_outputs(got, want), f"through the router {got}, a server without cache {want}"
        replies.append(got)
        print(f"  {len(ids)} tokens: {time.monotonic() - begun:.2f} s, cached {got.cached} "
              f"(device {got.device}, host {got.host}, storage {got.storage})")
    return replies


@pytest.mark.parametrize("pd", PLAIN_PAIRS, indirect=True)
def test_a_plain_pd_pair_answers_as_a_server_without_cache(pd: PdDeployment, reference: Reference):
    replies = run_workload(pd, reference)
    # The prefill server's radix cache hits (the shared system prompt at
    # least) are reported by the decode server, through the router.
    assert all(r.cached == r.device and r.host == r.storage == 0 for r in replies), replies
    assert sum(r.device >= 4 * PAGE for r in replies[1:]) == len(replies) - 1, replies


def store_observer(pd: PdDeployment) -> tuple[StorageBackend, str, str]:
    """A client of the domain's store that holds no part of it, and the
    tenant and key suffix the decode server's offload writes under (its log
    says them)."""
    assert pd.daemons is not None and pd.decode is not None and pd.decode.process is not None
    line = pd.decode.process.wait_lines("cpcache: store", 1, timeout_s=120)[0]
    found = re.search(r"tenant (\w+), keys ending '(\w*)'", line)
    assert found, line
    config = dataclasses.replace(domain_config(str(pd.daemons.config)), storage_segment_bytes=0)
    if config.storage == "file":
        return FileBackend(config.storage_root, 0), found[1], found[2]
    from cpcache.dataplane.storage.mooncake import MooncakeBackend

    return MooncakeBackend(config.storage_master, config.storage_metadata_server, [], global_segment_size=0,
                           local_buffer_size=0), found[1], found[2]


def wait_offloaded(pd: PdDeployment, tokens: list[int], timeout_s: float = 120.0, generation: int = 0) -> None:
    """Until the store holds every page of `tokens` (named as after the
    prefill server's `generation`-th flush): the decode server's offload
    writes them after the reply, and a next turn sent sooner would find
    part of them."""
    store, tenant, suffix = store_observer(pd)
    keys = [f"{tenant}.{h}_{suffix}" if suffix else f"{tenant}.{h}"
            for h in generation_pages(chain(tokens, PAGE, None), generation)]
    deadline = time.monotonic() + timeout_s
    try:
        while (present := store.exists_prefix(keys)) < len(keys):
            assert time.monotonic() < deadline, f"{present} of {len(keys)} offloaded pages stored in {timeout_s} s"
    finally:
        store.close()


ANSWER = 2 * PAGE + 3  # tokens a turn's answer has: two pages of it are offloaded by the decode server


def conversation(reference: Reference, seed: int) -> list[tuple[list[int], Reply]]:
    """Two turns: the second prompt holds the first prompt, its answer (as
    the reference server gave it) and a new question."""
    system, (doc,) = workload(seed=seed, docs=1)
    first = prompt(system, doc, 0, 0)
    answer = reference.reply(first, ANSWER)
    second = first + list(answer.output_ids) + [7, 8, 9]
    return [(first, answer), (second, reference.reply(second, ANSWER))]


@pytest.mark.parametrize("pd", CPCACHE_PAIRS, indirect=True)
def test_the_next_turn_finds_the_previous_answer_in_storage_after_decode_offload(pd: PdDeployment,
                                                                                 reference: Reference):
    (first, want_first), (second, want_second) = conversation(reference, 71)
    got = pd.generate(first, ANSWER)
    assert same_outputs(got, want_first), f"through the router {got}, a server without cache {want_first}"
    offloaded = (len(first) + ANSWER - 1) // PAGE * PAGE  # the decode server offloads whole pages of prompt + answer
    wait_offloaded(pd, (first + list(got.output_ids))[:offloaded])
    got = pd.generate(second, ANSWER)
    assert same_outputs(got, want_second), f"through the router {got}, a server without cache {want_second}"
    print(f"second turn of {len(second)} tokens: cached {got.cached} (device {got.device}, host {got.host}, "
          f"storage {got.storage}); the prefill server computed {len(first) // PAGE * PAGE} of them")
    # The prefill server never computed the answer's KV: every cached token
    # past the first prompt's pages came from the decode server's offload.
    assert got.cached >= offloaded > len(first) // PAGE * PAGE and got.storage > 0, got


@pytest.mark.parametrize("pd", CPCACHE_PAIRS, indirect=True)
def test_after_a_prefill_flush_the_next_turn_still_finds_the_decode_servers_offload(pd: PdDeployment,
                                                                                    reference: Reference):
    """The prefill server names its pages anew at a flush; its rank 0
    publishes the generation in the store, and the decode server's offload
    names the answer's pages by it."""
    assert pd.prefill is not None and pd.prefill.process is not None
    published = "published flush generation"
    before = len(pd.prefill.process.wait_lines(published, 1, timeout_s=120))  # generation 0, at start
    pd.prefill.flush_cache()
    line = pd.prefill.process.wait_lines(published, before + 1, timeout_s=120)[-1]
    found = re.search(published + r" (\d+)", line)
    assert found and int(found[1]) >= 1, line
    (first, want_first), (second, want_second) = conversation(reference, 73)
    got = pd.generate(first, ANSWER)
    assert same_outputs(got, want_first), f"through the router {got}, a server without cache {want_first}"
    offloaded = (len(first) + ANSWER - 1) // PAGE * PAGE
    wait_offloaded(pd, (first + list(got.output_ids))[:offloaded], generation=int(found[1]))
    got = pd.generate(second, ANSWER)
    assert same_outputs(got, want_second), f"through the router {got}, a server without cache {want_second}"
    assert got.cached >= offloaded > len(first) // PAGE * PAGE and got.storage > 0, got


@pytest.mark.parametrize("pd", DEFAULTS_PAIRS, indirect=True)
def test_with_the_daemons_defaults_the_previous_answer_is_found_and_every_page_read_is_used(pd: PdDeployment,
                                                                                           reference: Reference):
    """The docs' PD recipe with the daemons' defaults (threshold 0, best_effort
    and its bounded wait): the previous answer, two pages, comes from storage,
    and the daemons count what their prefetches read and threw away."""
    assert pd.daemons is not None
    for seed in (71, 72, 73):
        (first, want_first), (second, want_second) = conversation(reference, seed)
        got = pd.generate(first, ANSWER)
        assert same_outputs(got, want_first), f"through the router {got}, a server without cache {want_first}"
        offloaded = (len(first) + ANSWER - 1) // PAGE * PAGE
        wait_offloaded(pd, (first + list(got.output_ids))[:offloaded])
        got = pd.generate(second, ANSWER)
        assert same_outputs(got, want_second), f"through the router {got}, a server without cache {want_second}"
        assert got.cached >= offloaded > len(first) // PAGE * PAGE and got.storage > 0, got
    stats = []
    for rank in range(2):
        with Client(pd.daemons.socket(rank), timeout_s=10) as daemon:
            stats.append(daemon.stats())
    short = [(s["prefetches_short"], s["lost_hit_pages_prefetch_late"] + s["lost_hit_pages_read_failed"])
             for s in stats]
    print(f"prefetches ended short, pages read and thrown away, per rank: {short}")
    for s in stats:
        assert s["prefetch_asked_pages"] == s["storage_hit_pages"] + s["prefetch_resident_pages"] + sum(
            s[f"lost_hit_pages_{r}"] for r in ("storage_miss", "below_threshold", "host_full", "revoked",
                                               "prefetch_late", "read_failed"))
        assert s["lost_hit_pages_below_threshold"] == 0


@pytest.mark.parametrize("pd", CPCACHE_PAIRS, indirect=True)
def test_a_prefill_server_over_cpcache_at_tp2_cp2_answers_as_a_server_without_cache(pd: PdDeployment,
                                                                                     reference: Reference):
    replies = run_workload(pd, reference)
    second = replies[len(replies) // 2:]
    assert sum(r.device for r in replies) > 0, f"no device hit: {replies}"
    assert sum(r.host for r in second) > 0, f"no host hit: {second}"
    assert sum(r.storage for r in second) > 0, f"no storage hit: {second}"
    assert all(r.cached == r.device + r.host + r.storage for r in replies), replies
    # Both ranks of the prefill server (CP rank 0 sends the KV, CP rank 1
    # does not) took the same decisions: each logs its decision log at a flush.
    assert pd.prefill is not None and pd.prefill.process is not None
    before = len(pd.prefill.log_lines("decision log:"))  # the module's earlier flushes logged theirs
    pd.prefill.flush_cache()
    logs = pd.prefill.process.wait_lines("decision log:", before + 2, timeout_s=60)[before:]
    digests = {m[1]: m[2] for m in (DECISION_LOG.search(line) for line in logs) if m}
    assert len(digests) == 2 and len(set(digests.values())) == 1, f"the ranks' decisions differ: {logs}"



@dataclasses.dataclass
class PdStack:
    """A PD deployment over cpcache as the SGLang suite's checks see a stack
    (tests/sglang/stacks.py): the prefill server is the one over the daemons,
    requests go through the router, the reference is the module's."""

    pd: PdDeployment
    expected: Reference
    load_back: str = "overlapped"
    ranks: int = 2
    shape: Shape = Shape("qwen3", tp=2, cp=2)  # the prefill server's

    @property
    def cpcache(self) -> Server:
        assert self.pd.prefill is not None
        return self.pd.prefill

    @property
    def daemons(self) -> Daemons:
        assert self.pd.daemons is not None
        return self.pd.daemons

    def generate(self, ids: list[int], dp_rank: int | None = None) -> Reply:
        return self.pd.generate(ids)

    def reference(self, ids: list[int]) -> Reply:
        return self.expected.reply(ids)

    def check(self, ids: list[int], dp_rank: int | None = None) -> Reply:
        got, want = self.generate(ids), self.reference(ids)
        assert same_outputs(got, want), f"through the router {got}, a server without cache {want}"
        return got


@pytest.mark.parametrize("pd", CPCACHE_PAIRS, indirect=True)
def test_a_prefill_daemon_killed_mid_run_costs_the_tiers_not_the_pair(pd: PdDeployment, reference: Reference):
    kill_daemon_mid_run_and_come_back(PdStack(pd, reference), seed=30)  # type: ignore[arg-type]
