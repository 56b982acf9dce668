"""The overlapped load-back through `sglang.launch_server` at tp 2: a host
hit's forward starts once the load's round opened it, each layer waiting
for its own copy (the daemons' copies slowed layer by layer), with outputs
equal to a `--disable-radix-cache` server's; a copy that fails mid-load
stops the server loudly, never answering from KV that is not there; and,
with CPCACHE_SGLANG_MORE=1, TTFT of host hits against the blocking
load-back (`"load_back": "blocking"`), a short run of `cpcache bench
load-back` with every answer checked.

Runs alone with `pytest -m sglang tests/sglang/test_load_back.py`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from cpcache.testing import load_back
from cpcache.testing.sglang_cpu.servers import SGLANG_PYTHON, Reply
from cpcache.testing.sglang_cpu.stacks import Reference, prompt, started, workload
from tests.sglang.stacks import References
from tests.support.budget import beyond_budget

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason=f"SGLang's environment is not built ({SGLANG_PYTHON}); "
                       "`make setup` builds it"),
]


@pytest.fixture(scope="module")
def reference(references: References) -> Iterator[Reference]:
    """The file's reference server (the session's, of SHAPE's model)."""
    with references.use(load_back.SHAPE) as reference:
        yield reference


def test_host_hits_start_their_forward_before_the_copy_ends_and_answer_alike(tmp_path_factory, reference: Reference):
    with load_back.servers(tmp_path_factory.mktemp("load-back"), reference.server.model, reference=reference,
                           modes=("overlapped",)) as stacks:
        overlapped = stacks["overlapped"]
        system, docs = workload(seed=5, docs=load_back.DOCS)
        for d, doc in enumerate(docs):
            overlapped.check(prompt(system, doc, 0, d))
        again = [overlapped.check(prompt(system, docs[d], 1, d)) for d in (0, 1)]
        assert sum(r.host for r in again) > 0, f"no host hit: {again}"  # loaded overlapped, answered alike
        assert overlapped.cpcache.process is not None
        assert not overlapped.cpcache.process.lines_with("LoadBackFailed")


# The blocking load-back serves host hits in tests/sglang/test_server.py.
@beyond_budget
def test_one_block_of_the_load_back_measurement_hits_the_host_both_ways(tmp_path_factory, reference: Reference):
    with load_back.servers(tmp_path_factory.mktemp("load-back-both"), reference.server.model,
                           reference=reference) as stacks:
        # `cpcache bench load-back` runs the long one: host hits both ways,
        # every answer checked against the reference.
        report = load_back.measure(stacks, blocks=1)
        print("load-back TTFT:", json.dumps(report))
        assert all(report["host_hit_requests"].values()), report
        for stack in stacks.values():
            assert stack.cpcache.process is not None and not stack.cpcache.process.lines_with("LoadBackFailed")


def test_a_load_failing_mid_copy_stops_the_server_loudly_and_answers_nothing_wrong(tmp_path_factory,
                                                                                   reference: Reference):
    system, docs = workload(seed=9, docs=load_back.DOCS)
    # Rank 1's load-backs copy layer 0 (slowly: the forward has started by
    # then), then fail at layer 1.
    failing = {1: dict(fault_copy_layer_delay_ms=50.0, fault_load_fail_layer=1)}
    with started(tmp_path_factory.mktemp("failing"), reference.server.model, load_back.SHAPE, per_rank=failing,
                 copy_delay_ms=0.0, storage_delay_ms=0.0, reference=reference) as stack:
        server = stack.cpcache.process
        assert server is not None
        answered: list[Reply] = []
        with pytest.raises((OSError, KeyError)):  # the server goes down under the request whose load failed
            for turn in range(3):
                for d, doc in enumerate(docs):
                    answered.append(stack.check(prompt(system, doc, turn, d)))
        assert all(r.host == 0 for r in answered), f"a host hit was answered although every load fails: {answered}"
        assert server.proc.wait(timeout=120) != 0
        failed = server.lines_with("LoadBackFailed")
        assert failed, "the server stopped without saying why"
        print(f"stopped after {len(answered)} correct replies: {failed[-1].strip()}")
