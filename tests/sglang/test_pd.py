"""SGLang's prefill/decode disaggregation on the CPU: a prefill server and a
decode server (`python -m sglang.launch_server --disaggregation-mode ...`,
Mooncake's transfer engine over TCP on loopback) behind SGLang's router
(cpcache/testing/sglang_cpu/pd.py), with a tiny random Qwen3.

A multi-turn workload (a shared system prompt, documents that overflow the
prefill server's device pool, then asked about again in reverse) goes
through the router; every reply must equal, token for token and logprob for
logprob, a `--disable-radix-cache` server's without disaggregation (tp 1,
run first and stopped before the pair starts: one deployment at a time).
First a plain pair (prefill tp 1 with SGLang's radix cache), then a prefill
server at tp 2 and attention CP 2 over cpcache daemons (host tier, file
storage): its device, host and storage hits come back through the router
in the decode server's reply.

Runs alone with `pytest -m sglang tests/sglang/test_pd.py`.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cpcache.testing.sglang_cpu.pd import PdDeployment, over_cpcache
from cpcache.testing.sglang_cpu.servers import (
    PLAIN_FLAGS,
    SGLANG_PYTHON,
    Reply,
    Server,
    make_tiny_model,
    same_outputs,
    sglang_interpreter,
)
from cpcache.testing.sglang_cpu.stacks import DEVICE_TOKENS, PAGE, prompt, workload

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason=f"SGLang's environment is not built ({SGLANG_PYTHON}); "
                       "`make setup` builds it"),
]

DECISION_LOG = re.compile(r"rank (\d+) decision log: (\d+ steps, digest \w+)")


def requests() -> list[list[int]]:
    """Every document once, then each again (another turn) in reverse: the
    latest are still on the prefill's device, the ones before them in
    cpcache's host pool, the first ones in storage only."""
    system, docs = workload(seed=5)
    order = [*range(len(docs)), *reversed(range(len(docs)))]
    return [prompt(system, docs[d], turn=int(i >= len(docs)), question=d) for i, d in enumerate(order)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    found = subprocess.run([sglang_interpreter(), "-c", "import importlib.util as u, sys; "
                            "sys.exit(not (u.find_spec('sglang_router') and u.find_spec('mooncake')))"], timeout=60)
    if found.returncode != 0:
        pytest.skip(f"SGLang's environment ({SGLANG_PYTHON}) has no sglang-router or Mooncake transfer engine: "
                    "`make setup` installs them")
    return make_tiny_model(tmp_path_factory.mktemp("pd-model") / "tiny-qwen3", "qwen3")


class Reference:
    """A `--disable-radix-cache` tp 1 server without disaggregation, up for
    the whole module and paused (SIGSTOP) between its answers: an idle
    SGLang server's loops spin, and would take a core from the PD pair."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.replies: dict[tuple[tuple[int, ...], int], Reply] = {}

    def reply(self, ids: list[int], max_new_tokens: int = 4) -> Reply:
        key = (tuple(ids), max_new_tokens)
        if key not in self.replies:
            assert self.server.process is not None
            self.server.process.resume()
            try:
                self.replies[key] = self.server.generate(ids, max_new_tokens)
            finally:
                self.server.process.pause()
        return self.replies[key]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, model: Path) -> Iterator[Reference]:
    work = tmp_path_factory.mktemp("pd-reference")
    server = Server("reference", model, work, PLAIN_FLAGS, tp=1, page_size=PAGE, device_tokens=DEVICE_TOKENS)
    try:
        server.start().wait_ready()
        assert server.process is not None
        server.process.pause()
        yield Reference(server)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def pd(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model: Path,
       reference: Reference) -> Iterator[PdDeployment]:
    """One deployment at a time (module scope, one instance per parameter:
    pytest stops one before it starts the next)."""
    work = tmp_path_factory.mktemp(f"pd-{request.param}")
    options = dict(page_size=PAGE, device_tokens=DEVICE_TOKENS)
    if request.param == "plain":
        deployment = PdDeployment(work, model, **options)
    else:
        deployment = over_cpcache(work, model, tp=2, cp=2, **options)
    try:
        deployment.start().wait_ready()
        memory = {name: f"{rss / 2**30:.2f} GiB" for name, rss in deployment.memory_bytes().items()}
        print(f"\nPD {request.param}: healthy after {deployment.ready_s} s; resident memory {memory}")
        yield deployment
    finally:
        deployment.stop()


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


@pytest.mark.parametrize("pd", ["plain"], indirect=True)
def test_a_plain_pd_pair_answers_as_a_server_without_cache(pd: PdDeployment, reference: Reference):
    replies = run_workload(pd, reference)
    # The prefill server's radix cache hits (the shared system prompt at
    # least) are reported by the decode server, through the router.
    assert all(r.cached == r.device and r.host == r.storage == 0 for r in replies), replies
    assert sum(r.device >= 4 * PAGE for r in replies[1:]) == len(replies) - 1, replies


ANSWER = 2 * PAGE + 3  # tokens a turn's answer has: two pages of it are offloaded by the decode server


def conversation(reference: Reference, seed: int) -> list[tuple[list[int], Reply]]:
    """Two turns: the second prompt holds the first prompt, its answer (as
    the reference server gave it) and a new question."""
    system, (doc,) = workload(seed=seed, docs=1)
    first = prompt(system, doc, 0, 0)
    answer = reference.reply(first, ANSWER)
    second = first + list(answer.output_ids) + [7, 8, 9]
    return [(first, answer), (second, reference.reply(second, ANSWER))]


@pytest.mark.parametrize("pd", ["cpcache-tp2-cp2"], indirect=True)
def test_the_next_turn_finds_the_previous_answer_in_storage_after_decode_offload(pd: PdDeployment,
                                                                                 reference: Reference):
    (first, want_first), (second, want_second) = conversation(reference, 71)
    got = pd.generate(first, ANSWER)
    assert same_outputs(got, want_first), f"through the router {got}, a server without cache {want_first}"
    offloaded = (len(first) + ANSWER - 1) // PAGE * PAGE  # the decode server offloads whole pages of prompt + answer
    got = pd.generate(second, ANSWER)
    assert same_outputs(got, want_second), f"through the router {got}, a server without cache {want_second}"
    print(f"second turn of {len(second)} tokens: cached {got.cached} (device {got.device}, host {got.host}, "
          f"storage {got.storage}); the prefill server computed {len(first) // PAGE * PAGE} of them")
    # The prefill server never computed the answer's KV: every cached token
    # past the first prompt's pages came from the decode server's offload.
    # (Before any flush: a flush of the prefill server seeds its page chains
    # anew, which the decode server's offload does not follow.)
    assert got.cached >= offloaded > len(first) // PAGE * PAGE and got.storage > 0, got


@pytest.mark.parametrize("pd", ["cpcache-tp2-cp2"], indirect=True)
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
    pd.prefill.flush_cache()
    logs = pd.prefill.process.wait_lines("decision log:", 2, timeout_s=60)
    digests = {m[1]: m[2] for m in (DECISION_LOG.search(line) for line in logs) if m}
    assert len(digests) == 2 and len(set(digests.values())) == 1, f"the ranks' decisions differ: {logs}"

