"""Side by side, in one run, on one workload: real SGLang servers at
`--tp 2 --attn-cp-size 2` (tiny random Qwen3) with SGLang's own HiCache
(host memory twice the device pool, its `file` storage tier beneath), its
plain radix cache (with CPCACHE_SGLANG_MORE=1), and cpcache (a host pool of the same pages, file
storage beneath, over `cpcache launch --tp 2 --cp 2` daemons), every reply
checked against a tp 1 server without cache (the session's).

The workload is a multi-turn one with a shared system prompt: documents that
overflow the device pool and the host pool come back in later turns. Each
request goes to every server in turn, the others paused (SIGSTOP), so each
is measured alone. Reported per server: hit rate per tier, SGLang's own e2e
latency per request (4 tokens out: mostly the prefill), prompt tokens per
second, and the storage each tier wrote; written to `hit-rates.json` in the
run's directory and printed.

Every server runs with SGLang's `--sleep-on-idle`, which operators set to
keep idle schedulers off the CPU: cpcache's hits and answers must be the
same with it (each server is paused right after its reply, so this shows
the flag's start and serving path, not an hour of idle loops).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest

from cpcache.client import Client
from cpcache.testing.sglang_cpu.hicache import HICACHE_ENV, HICACHE_FLAGS, hicache_file_storage_flags
from cpcache.testing.sglang_cpu.servers import (
    SGLANG_PYTHON,
    Reply,
    Server,
    same_outputs,
    start_paused,
)
from cpcache.testing.sglang_cpu.stacks import (
    DEVICE_TOKENS,
    HOST_PAGES,
    PAGE,
    Reference,
    Shape,
    Stack,
    prompt,
    workload,
)
from tests.sglang.stacks import References
from tests.support.budget import MORE

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason=f"SGLang's environment is not built ({SGLANG_PYTHON}); "
                       "`make setup` builds it"),
]

SHAPE = Shape("qwen3", tp=2, cp=2, storage="file")


def turns(system: list[int], docs: list[list[int]]) -> list[list[int]]:
    """Three turns: in order, in reverse, and in order again."""
    order = [list(range(len(docs))), list(reversed(range(len(docs)))), list(range(len(docs)))]
    return [prompt(system, docs[d], t, d) for t, ds in enumerate(order) for d in ds]


def summary(replies: list[Reply], prompts: list[list[int]], seconds: float) -> dict[str, float]:
    tokens = sum(len(p) for p in prompts)
    return {"hit": sum(r.cached for r in replies) / tokens, "device": sum(r.device for r in replies) / tokens,
            "host": sum(r.host for r in replies) / tokens, "storage": sum(r.storage for r in replies) / tokens,
            "e2e_latency_median_s": statistics.median(r.latency_s for r in replies),
            "prompt_tokens_per_s": tokens / seconds}


def daemon_stats(stack: Stack, rank: int) -> dict[str, int]:
    """The rank's prefetch-hold counters, as its daemon's `Stats` gives them."""
    with Client(stack.daemons.socket(rank), timeout_s=10) as daemon:
        stats = daemon.stats()
    return {k: stats[k] for k in ("prefetch_holds_taken", "prefetch_held_pages", "prefetch_holds_expired")}


def stored_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_cpcache_hits_at_least_what_sglangs_hicache_with_file_storage_hits_under_cp(tmp_path: Path,
                                                                                   references: References):
    with references.use(SHAPE) as reference:
        measure(tmp_path, references.model(SHAPE.family), reference)


def measure(tmp_path: Path, model: Path, reference: Reference) -> None:
    # cpcache's stack without I/O faults: a measurement, not a perturbation.
    # The reference is the session's (it sleeps when idle).
    stack = Stack(tmp_path, model, SHAPE, copy_delay_ms=0.0, storage_delay_ms=0.0, per_rank={}, sleep_on_idle=True,
                  reference=reference)
    common = dict(model=model, work=tmp_path, tp=SHAPE.tp, cp=SHAPE.cp, page_size=PAGE, device_tokens=DEVICE_TOKENS,
                  sleep_on_idle=True)
    hicache_root = tmp_path / "hicache-pages"
    # SGLang's plain radix cache beside them with CPCACHE_SGLANG_MORE=1 (a
    # server more than the suite's budget holds).
    servers: dict[str, Server] = {
        **({"radix": Server("radix", flags=[], **common)} if MORE else {}),
        "hicache": Server("hicache", flags=[*HICACHE_FLAGS, *hicache_file_storage_flags(hicache_root)],
                          env=HICACHE_ENV, **common),
        "cpcache": stack.cpcache,
    }
    replies: dict[str, list[Reply]] = {name: [] for name in servers}
    seconds = {name: 0.0 for name in servers}
    try:
        stack.daemons.start()
        start_paused(servers.values())
        system, docs = workload(seed=7)
        prompts = turns(system, docs)
        assert stack.plain is not None
        stack.plain.wait_ready()
        expected = [stack.reference(ids) for ids in prompts]
        for ids in prompts:  # every server sees the workload in the same order, each alone on the machine
            for name, server in servers.items():
                assert server.process is not None
                server.process.resume()
                began = time.monotonic()
                replies[name].append(server.generate(ids))
                seconds[name] += time.monotonic() - began
                server.process.pause()
        holds = [daemon_stats(stack, rank) for rank in range(SHAPE.tp)]
    finally:
        for server in servers.values():
            server.stop()
        stack.daemons.stop()

    assert stack.cpcache.process is not None
    fell = stack.cpcache.process.lines_with("fell back to the device tree")
    assert not fell, f"cpcache left its daemons during the measurement: {fell}"
    for name, got in replies.items():
        wrong = [i for i, (a, b) in enumerate(zip(got, expected)) if not same_outputs(a, b)]
        assert not wrong, f"{name}: requests {wrong} answered unlike a server without cache"
    report: dict[str, dict] = {name: summary(got, prompts, seconds[name]) for name, got in replies.items()}
    report["hicache"]["stored_bytes"] = stored_bytes(hicache_root)
    report["cpcache"]["stored_bytes"] = stored_bytes(stack.storage)
    report["workload"] = {"requests": len(prompts), "prompt_tokens": sum(len(p) for p in prompts),
                          "device_pages": DEVICE_TOKENS // PAGE, "host_pages": HOST_PAGES, "topology": SHAPE.name}
    (tmp_path / "hit-rates.json").write_text(json.dumps(report, indent=1))
    print("hit rates:", json.dumps(report))
    assert "radix" not in report or report["cpcache"]["hit"] > report["radix"]["hit"]
    assert report["cpcache"]["host"] > 0
    assert report["cpcache"]["storage"] > 0
    assert report["cpcache"]["hit"] >= report["hicache"]["hit"]
    # Every prefetch that brought pages held them until its request was
    # admitted, and SGLang's admission released each: none is left, none expired.
    assert all(h == holds[0] for h in holds) and holds[0]["prefetch_holds_taken"] > 0, holds
    assert holds[0]["prefetch_held_pages"] == holds[0]["prefetch_holds_expired"] == 0, holds
