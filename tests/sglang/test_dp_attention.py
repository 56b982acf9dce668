"""Attention data parallelism end to end: a real `sglang.launch_server` at
`--tp 2 --enable-dp-attention --dp 2` with a tiny DeepSeek-V2 (MLA, MoE;
Qwen3 opt-in) (two DP groups of attention TP 1,
each with its own scheduler and radix tree, the MLP shared) over
`cpcache launch --tp 2 --dp 2` daemons (one agreement domain per DP group),
file storage shared by both groups.

Every reply must equal a tp 1 server's without cache. Requests are routed
to a DP group by SGLang's own `routed_dp_rank`: one group's repeats hit its
device, host and storage tiers; the other group, which never computed those
documents, hits the pages the first one stored (one store, the same keys:
DP groups are replicas of one model shard). Each domain's decisions are its
own: the ranks of a DP group log the same decisions, the groups different
ones. `CPCACHE_SGLANG_TP4=1` adds `--tp 4 --dp 2` (two attention-TP ranks
per group) and `--tp 4 --dp 2 --attn-cp-size 2` (two CP ranks per group).

Runs alone with `pytest -m sglang tests/sglang/test_dp_attention.py`.
"""

from __future__ import annotations

import os

import pytest

from cpcache.testing.sglang_cpu.servers import SGLANG_PYTHON
from cpcache.testing.sglang_cpu.stacks import Shape, Stack, prompt, workload
from cpcache.topology import Topology
from tests.sglang.stacks import References, kill_daemon_mid_run_and_come_back, stack_of

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(1500),
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason=f"SGLang's environment is not built ({SGLANG_PYTHON}); "
                       "`make setup` builds it"),
]

# DeepSeek's serving shape: MLA and MoE under attention DP. The DP groups'
# domains are the same with grouped KV heads: Qwen3's shape is opt-in
# (CPCACHE_SGLANG_QWEN3_DP=1), as are the four-rank shapes (CPCACHE_SGLANG_TP4=1).
MLA_DP = Shape("deepseek_v2", tp=2, dp=2, storage="file")
DP = Shape("qwen3", tp=2, dp=2, storage="file")
DP_TP4 = Shape("qwen3", tp=4, dp=2, storage="file")
DP_CP_TP4 = Shape("qwen3", tp=4, dp=2, cp=2, storage="file")  # DP groups of two CP ranks
SHAPES = [MLA_DP, *([DP] if os.environ.get("CPCACHE_SGLANG_QWEN3_DP") else []),
          *([DP_TP4, DP_CP_TP4] if os.environ.get("CPCACHE_SGLANG_TP4") else [])]


@pytest.fixture(scope="module", params=SHAPES, ids=[s.name for s in SHAPES])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, references: References):
    shape: Shape = request.param
    with stack_of(shape, tmp_path_factory.mktemp(shape.name), references) as stack:
        yield stack


def test_each_dp_group_hits_every_tier_the_other_hits_its_stored_pages_and_each_domain_decides_alone(stack: Stack):
    shape = stack.shape
    system, docs = workload(seed=5)
    first = [stack.check(prompt(system, doc, 0, d), dp_rank=0) for d, doc in enumerate(docs)]
    again = [stack.check(prompt(system, docs[d], 1, d), dp_rank=0) for d in reversed(range(len(docs)))]
    assert sum(r.device for r in first + again) > 0, "no device hit"
    assert sum(r.host for r in again) > 0, f"no host hit: {again}"
    assert sum(r.storage for r in again) > 0, f"no storage hit: {again}"
    # DP group 1 never computed these documents: its hits beyond the shared
    # system prompt come from the pages group 0 stored.
    other = [stack.check(prompt(system, doc, 2, d), dp_rank=1) for d, doc in enumerate(docs[:3])]
    assert all(r.storage >= len(docs[0]) // 2 for r in other), f"group 1 missed group 0's pages: {other}"
    print(f"{shape.name}: group 0 device/host/storage tokens {sum(r.device for r in again)}/"
          f"{sum(r.host for r in again)}/{sum(r.storage for r in again)}; group 1 storage "
          f"{sum(r.storage for r in other)}")

    assert stack.cpcache.process is not None
    before = len(stack.cpcache.log_lines("decision log:"))  # earlier flushes logged theirs
    stack.cpcache.flush_cache()
    stack.cpcache.process.wait_lines("decision log:", before + stack.ranks, timeout_s=60)
    logs = stack.decision_logs()
    assert sorted(logs) == list(range(stack.ranks)), logs
    topology = Topology(tp=shape.tp, dp=shape.dp, cp=shape.cp)
    groups = [list(domain.ranks) for domain in topology.domains()]
    assert len(groups) == shape.dp, groups
    for group in groups:
        assert len({logs[rank] for rank in group}) == 1, f"the ranks of DP group {group} decided apart: {logs}"
    assert len({logs[group[0]] for group in groups}) == shape.dp, f"the DP groups' decisions are one log: {logs}"


def test_a_daemon_killed_mid_run_leaves_the_server_serving_and_every_slot_comes_back(stack: Stack):
    kill_daemon_mid_run_and_come_back(stack, seed=31)
