"""Attention context parallelism end to end: real `sglang.launch_server`
servers at `--tp 2 --attn-cp-size 2` (attention TP 1: both CP ranks hold the
same KV) over `cpcache launch --tp 2 --cp 2` daemons, with tiny random Qwen3
(grouped KV heads) and DeepSeek-V2 (multi-head latent attention, MoE)
models. In the suite: Qwen3 under prefill CP (zigzag) on Mooncake Store (a
real mooncake_master on loopback, the seed's shape) and DeepSeek-V2 under
prefill CP on files; prefill CP off, and each model on the other store,
with CPCACHE_SGLANG_MORE=1.

Every reply must equal a tp 1 server's without cache, token for token and
logprob for logprob; hits come from the device, the host pool and storage;
every rank's scheduler takes the same decisions at every iteration (their
decision logs are compared), though one rank's copies and storage are
twice as slow as the other's (what every rank is told is the slower one's
progress, agreed by MIN: tests/multirank prove that value). CP ranks of a
replicated page share one storage object, written by one of them.

Runs alone with `pytest -m sglang tests/sglang/test_cp.py`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cpcache.client import Client
from cpcache.testing.sglang_cpu.servers import (
    CPCACHE_FLAGS,
    READY,
    SGLANG_PYTHON,
    Daemons,
    Server,
)
from cpcache.testing.sglang_cpu.stacks import Shape, Stack, prompt, workload
from tests.sglang.stacks import (
    References,
    a_wrong_stored_page_breaks_the_match,
    flush_with_writes_in_flight_serves_no_wrong_bytes,
    kill_daemon_mid_run_and_come_back,
    requests_aborted_during_their_prefetch_are_revoked_on_every_rank,
    stack_of,
    stored_pages,
    wait_no_io,
)
from tests.support.budget import MORE

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(1500),
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason=f"SGLang's environment is not built ({SGLANG_PYTHON}); "
                       "`make setup` builds it"),
]

CP_FILE = Shape("qwen3", tp=2, cp=2, storage="file")
# The seed's scenario: prefill CP and Mooncake Store.
CP_ZIGZAG_MOONCAKE = Shape("qwen3", tp=2, cp=2, zigzag=True, storage="mooncake")
# DeepSeek-V2's multi-head latent attention (and MoE) under prefill CP: one
# latent per token, the same on every rank (attention TP 1), so one storage
# object per page. Without prefill CP, and on Mooncake Store, with
# CPCACHE_SGLANG_MORE=1 (tests/support/budget.py): each differs from a shape
# the suite runs by one thing the others cover. So does Qwen3 on files
# without prefill CP (CP_FILE): the hit-rate, attach-fault, soak and chaos
# tests serve that shape; its pages written once per page under GQA are
# what test_replicas_one_store.py's tp 1 replica reads back.
MLA_ZIGZAG_FILE = Shape("deepseek_v2", tp=2, cp=2, zigzag=True, storage="file")
MLA_FILE = Shape("deepseek_v2", tp=2, cp=2, storage="file")
MLA_ZIGZAG_MOONCAKE = Shape("deepseek_v2", tp=2, cp=2, zigzag=True, storage="mooncake")
MLA_FAMILIES = {"deepseek_v2"}
# Opt-in shapes, added to every test of every shape by their variable:
# - Qwen3-MoE under prefill CP: MoE under prefill CP is DeepSeek-V2's shape
#   already, which this machine's suite time keeps;
# - attention TP 2 x CP 2 (the demo's topology), GQA and MLA: four ranks and
#   their daemons beside a reference, more than this 2-core machine runs in
#   the suite's time.
CP_MOE_ZIGZAG = Shape("qwen3_moe", tp=2, cp=2, zigzag=True, storage="file")
CP_TP4 = Shape("qwen3", tp=4, cp=2, zigzag=True, storage="file")
MLA_TP4 = Shape("deepseek_v2", tp=4, cp=2, zigzag=True, storage="file")
OPT_IN = {"CPCACHE_SGLANG_QWEN3_MOE": [CP_MOE_ZIGZAG], "CPCACHE_SGLANG_TP4": [CP_TP4, MLA_TP4],
          "CPCACHE_SGLANG_MORE": [CP_FILE, MLA_FILE, MLA_ZIGZAG_MOONCAKE]}
OPT_IN_SHAPES = [shape for shapes in OPT_IN.values() for shape in shapes]
EVERY_SHAPE = [CP_ZIGZAG_MOONCAKE, MLA_ZIGZAG_FILE,
               *(shape for variable, shapes in OPT_IN.items() if os.environ.get(variable) for shape in shapes)]
FILE_SHAPES = [shape for shape in EVERY_SHAPE if shape.storage == "file"]


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, references: References):
    # The shapes of one model family share its tp 1 reference server (and
    # the replies it gave): the first test's workload is every shape's.
    shape: Shape = request.param
    with stack_of(shape, tmp_path_factory.mktemp(shape.name), references) as stack:
        yield stack


def by_shape(*shapes: Shape):
    return pytest.mark.parametrize("stack", shapes, indirect=True, ids=[s.name for s in shapes])


def daemon_counters(stack: Stack) -> list[dict[str, int]]:
    counters = []
    for rank in range(stack.ranks):
        with Client(stack.daemons.socket(rank)) as daemon:
            counters.append(dict(daemon.stats()))
    return counters


# First in the file, so first in the module: pytest runs it before any
# stack starts (it needs none). After them it would start beside the last
# stack, whose idle schedulers spin both cores of a 2-core machine.
def test_a_cp_server_over_daemons_of_another_cp_size_is_refused_at_start(tmp_path: Path, references: References):
    model = references.model("qwen3")
    daemons = Daemons(tmp_path / "run", tp=2, cp=1, settings=dict(storage="none"))
    config = tmp_path / "sglang-cpcache.json"
    config.write_text(json.dumps({"socket": str(tmp_path / "run" / "rank-{rank}.sock"), "model_id": "tiny"}))
    server = Server("cpcache", model, tmp_path, CPCACHE_FLAGS, tp=2, cp=2, env={"CPCACHE_SGLANG_CONFIG": str(config)})
    try:
        daemons.start()
        server.start()
        assert server.process is not None
        # The refusal is the scheduler's start failing; SGLang then takes a
        # while to tear its other ranks down, which is not what is tested.
        refused = server.process.wait_lines("the scheduler's topology is not this daemon's", 1, timeout_s=600)
        assert "cp" in refused[0], server.process.tail()
        assert not server.process.lines_with(READY), "the server started over daemons of another CP size"
    finally:
        server.stop()
        daemons.stop()


@by_shape(*EVERY_SHAPE)
def test_outputs_equal_tp1_with_hits_from_every_tier_and_one_decision_log_on_every_rank(stack: Stack):
    system, docs = workload()
    replies = [stack.check(prompt(system, doc, 0, d)) for d, doc in enumerate(docs)]
    # Back in reverse: the latest documents are still on the device, the
    # ones before them in the host pool, the first ones in storage only.
    second = [stack.check(prompt(system, docs[d], 1, d)) for d in reversed(range(len(docs)))]
    assert sum(r.device for r in replies + second) > 0, "no device hit"
    assert sum(r.host for r in second) > 0, f"no host hit: {second}"
    assert sum(r.storage for r in second) > 0, f"no storage hit: {second}"
    print(f"{stack.shape.name}: second pass device/host/storage tokens "
          f"{sum(r.device for r in second)}/{sum(r.host for r in second)}/{sum(r.storage for r in second)}")
    if stack.shape.zigzag:
        # The prefills were split over the CP ranks (cp_torch_native.py says so once per rank).
        assert len(stack.cpcache.log_lines("prefill CP attention")) >= stack.ranks
    # Each rank's backend logs its decision log at a flush: one log, every rank.
    before = len(stack.cpcache.log_lines("decision log:"))  # earlier flushes logged theirs
    stack.cpcache.flush_cache()
    logs = stack.cpcache.process.wait_lines("decision log:", before + stack.ranks, timeout_s=60)[before:] \
        if stack.cpcache.process else []
    digests = stack.decision_logs()
    assert len(digests) == stack.ranks and len(set(digests.values())) == 1, f"the ranks' decisions differ: {logs}"


@by_shape(*FILE_SHAPES)
def test_cp_ranks_of_a_replicated_page_share_one_storage_object_written_once(stack: Stack):
    system, docs = workload(seed=8, docs=4)
    for d, doc in enumerate(docs):
        stack.check(prompt(system, doc, 0, d))
    for rank in range(stack.ranks):  # every write through to storage ended
        wait_no_io(stack, rank)
    files = stored_pages(stack, system + docs[0])
    names = {p.name for p in files}
    assert files and all("_cp" not in name for name in names), f"a CP suffix on replicated pages: {names}"
    # One object per page and attention-TP shard of its heads: MLA's latent is
    # not split over attention TP, so it is one object whatever the TP.
    shape = stack.shape
    shards = 1 if shape.family in MLA_FAMILIES else shape.tp // (shape.cp * shape.dp)
    objects: dict[str, set[str]] = {}
    for name in names:
        objects.setdefault(name.split(".")[1].split("_")[0], set()).add(name)
    assert all(len(keys) == shards for keys in objects.values()), f"not {shards} object(s) per page: {objects}"
    written = [c.get("pages_moved_host_to_storage", 0) for c in daemon_counters(stack)]
    stored = sum(1 for p in stack.storage.rglob("*.*") if not p.name.startswith("."))  # temp files are hidden
    # One elected writer per object (by the page's hash): every rank writes, no object twice.
    assert all(w > 0 for w in written) and sum(written) <= stored, (written, stored)


@by_shape(*FILE_SHAPES)
def test_a_wrong_page_from_storage_breaks_the_match_negative_control(stack: Stack):
    a_wrong_stored_page_breaks_the_match(stack)


# Under the seed's shape (prefill CP, Mooncake Store); test_server.py has
# both on files at plain TP.
SEED_SHAPES = [shape for shape in EVERY_SHAPE if shape is CP_ZIGZAG_MOONCAKE or shape is CP_FILE]


@by_shape(*SEED_SHAPES)
def test_requests_aborted_during_their_prefetch_are_revoked_on_every_rank(stack: Stack):
    requests_aborted_during_their_prefetch_are_revoked_on_every_rank(stack)


@by_shape(*SEED_SHAPES)
def test_flush_cache_while_writes_are_in_flight_serves_no_wrong_bytes(stack: Stack):
    flush_with_writes_in_flight_serves_no_wrong_bytes(stack)


# GQA on Mooncake Store (the seed's storage). MLA's daemon killed under
# attention DP is test_dp_attention.py's, under prefill CP here with
# CPCACHE_SGLANG_MORE=1; test_server.py kills one at plain TP.
KILLED_SHAPES = [shape for shape in EVERY_SHAPE
                 if shape.storage == "mooncake" or shape in OPT_IN_SHAPES or MORE and shape is MLA_ZIGZAG_FILE]


@by_shape(*KILLED_SHAPES)
def test_a_daemon_killed_mid_run_leaves_the_server_serving_and_every_slot_comes_back(stack: Stack):
    kill_daemon_mid_run_and_come_back(stack, seed=30)
