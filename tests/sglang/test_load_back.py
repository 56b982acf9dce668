"""The overlapped load-back through `sglang.launch_server` at tp 2: a host
hit's forward starts once the load's round opened it, each layer waiting
for its own copy (the daemons' copies slowed layer by layer), with outputs
equal to a `--disable-radix-cache` server's; TTFT of host hits against the
blocking load-back (`"load_back": "blocking"`), side by side in one run,
interleaved blocks; and a copy that fails mid-load stops the server loudly,
never answering from KV that is not there.

Runs alone with `pytest -m sglang tests/sglang/test_load_back.py`.
"""

from __future__ import annotations

import json
import statistics

import pytest

from cpcache.testing.sglang_cpu.servers import SGLANG_PYTHON, Reply, make_tiny_model
from cpcache.testing.sglang_cpu.stacks import Shape, Stack, prompt, started, workload

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason=f"SGLang's environment is not built ({SGLANG_PYTHON}); "
                       "`make setup` builds it"),
]

SHAPE = Shape("llama", tp=2)
LAYER_DELAY_MS = 25.0  # each layer of every load-back, on every rank
QUIET = dict(copy_delay_ms=0.0, storage_delay_ms=0.0, per_rank={})
BLOCKS = 5
DOCS = 6  # about twice the device pool: the first ones are host hits when asked again


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")


def _host_hits(stack: Stack, system: list[int], docs: list[list[int]], turn: int,
               reference: Stack) -> list[Reply]:
    """Every document once (the first ones leave the device pool), then the
    first two again, with a new question: their prefixes come from the host
    pool. -> the replies of those two, checked against the reference."""
    for d, doc in enumerate(docs):
        stack.cpcache.generate(prompt(system, doc, turn, d), max_new_tokens=1)
    replies = []
    for d in (0, 1):
        ids = prompt(system, docs[d], turn, 100 + d)
        got = stack.cpcache.generate(ids, max_new_tokens=1)
        want = reference.reference(ids)
        assert got.output_ids[:1] == want.output_ids[:1], f"answered {got}, a server without cache {want}"
        replies.append(got)
    return replies


def test_host_hits_start_their_forward_before_the_copy_ends_and_answer_alike(tmp_path_factory, model):
    system, docs = workload(seed=7, docs=DOCS)
    slowed = dict(daemon_settings=dict(fault_copy_layer_delay_ms=LAYER_DELAY_MS), **QUIET)
    with started(tmp_path_factory.mktemp("overlapped"), model, SHAPE, **slowed) as overlapped, \
            started(tmp_path_factory.mktemp("blocking"), model, SHAPE, backend={"load_back": "blocking"},
                    with_reference=False, **slowed) as blocking:
        # Outputs and logprobs equal the reference's, with host hits loaded overlapped.
        for d, doc in enumerate(docs):
            overlapped.check(prompt(system, doc, 0, d))
        again = [overlapped.check(prompt(system, docs[d], 1, d)) for d in (0, 1)]
        assert sum(r.host for r in again) > 0, f"no host hit: {again}"
        ttft: dict[str, list[float]] = {"overlapped": [], "blocking": []}
        hits: dict[str, int] = {"overlapped": 0, "blocking": 0}
        for block in range(BLOCKS):
            order = [("overlapped", overlapped), ("blocking", blocking)]
            for name, stack in order if block % 2 == 0 else order[::-1]:
                replies = _host_hits(stack, system, docs, 10 + block, overlapped)
                measured = [r for r in replies if r.host > 0]
                hits[name] += len(measured)
                if measured:
                    ttft[name].append(statistics.median(r.latency_s for r in measured))
        report = {name: {"ttft_ms_median_of_blocks": round(1000 * statistics.median(v), 1),
                         "blocks": [round(1000 * x, 1) for x in v], "host_hit_requests": hits[name]}
                  for name, v in ttft.items() if v}
        if len(report) == 2:
            report["ratio_overlapped_over_blocking"] = round(
                report["overlapped"]["ttft_ms_median_of_blocks"] / report["blocking"]["ttft_ms_median_of_blocks"], 3)
        print("load-back TTFT:", json.dumps(report))
        assert hits["overlapped"] > 0 and hits["blocking"] > 0, hits
        for stack in (overlapped, blocking):
            assert stack.cpcache.process is not None and not stack.cpcache.process.lines_with("LoadBackFailed")


def test_a_load_failing_mid_copy_stops_the_server_loudly_and_answers_nothing_wrong(tmp_path_factory, model):
    system, docs = workload(seed=9, docs=DOCS)
    # Rank 1's load-backs copy layer 0 (slowly: the forward has started by
    # then), then fail at layer 1.
    failing = {1: dict(fault_copy_layer_delay_ms=50.0, fault_load_fail_layer=1)}
    with started(tmp_path_factory.mktemp("failing"), model, SHAPE, per_rank=failing, copy_delay_ms=0.0,
                 storage_delay_ms=0.0) as stack:
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
