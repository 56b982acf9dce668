"""Side by side, in one run, on one workload: real SGLang servers at tp 2 with
SGLang's plain radix cache, SGLang's own HiCache (host memory twice the
device pool), and cpcache (a host pool of the same pages, file storage
beneath), every reply checked against a `--disable-radix-cache` server.

The workload is a multi-turn one with a shared system prompt: documents that
overflow the device pool (and the host pool) come back in later turns. The
hit rates are written to `hit-rates.json` in the run's directory and printed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from cpcache.tools.sglang_cpu.servers import (
    CPCACHE_FLAGS,
    CPU_HOST,
    PLAIN_FLAGS,
    SGLANG_PYTHON,
    Daemons,
    Reply,
    Server,
    make_tiny_model,
    same_outputs,
)
from tests.sglang.test_server import DEVICE_TOKENS, HOST_PAGES, PAGE, TP, prompt, workload

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason=f"SGLang's environment is not built ({SGLANG_PYTHON}); "
                       "`make setup` builds it"),
]

HICACHE = (CPU_HOST / "hicache_cpu.py").exists()


def turns(system: list[int], docs: list[list[int]]) -> list[list[int]]:
    """Three turns: in order, in reverse, and in order again."""
    order = [list(range(len(docs))), list(reversed(range(len(docs)))), list(range(len(docs)))]
    return [prompt(system, docs[d], t, d) for t, ds in enumerate(order) for d in ds]


def rates(replies: list[Reply], prompts: list[list[int]]) -> dict[str, float]:
    tokens = sum(len(p) for p in prompts)
    return {"hit": sum(r.cached for r in replies) / tokens, "device": sum(r.device for r in replies) / tokens,
            "host": sum(r.host for r in replies) / tokens, "storage": sum(r.storage for r in replies) / tokens}


def test_cpcache_hits_at_least_what_sglangs_own_caches_hit(tmp_path: Path):
    model = make_tiny_model(tmp_path / "tiny-llama")
    daemons = Daemons(tmp_path / "run", tp=TP, settings=dict(
        storage="file", storage_root=str(tmp_path / "pages"), host_pool_pages=HOST_PAGES,
        prefetch_threshold_tokens=0, prefetch_policy="wait_complete"))
    config = tmp_path / "sglang-cpcache.json"
    config.write_text(json.dumps({"socket": str(tmp_path / "run" / "rank-{rank}.sock"), "model_id": "tiny"}))
    common = dict(model=model, work=tmp_path, tp=TP, page_size=PAGE, device_tokens=DEVICE_TOKENS)
    servers = {
        "reference": Server("reference", flags=PLAIN_FLAGS, **common),
        "radix": Server("radix", flags=[], **common),
        "cpcache": Server("cpcache", flags=CPCACHE_FLAGS, env={"CPCACHE_SGLANG_CONFIG": str(config)}, **common),
    }
    if HICACHE:
        from cpcache.tools.sglang_cpu.servers import HICACHE_ENV, HICACHE_FLAGS

        servers["hicache"] = Server("hicache", flags=HICACHE_FLAGS, env=HICACHE_ENV, **common)
    try:
        daemons.start()
        for server in servers.values():
            server.start()
        for server in servers.values():
            server.wait_ready()
        system, docs = workload(seed=7)
        prompts = turns(system, docs)
        replies: dict[str, list[Reply]] = {name: [] for name in servers}
        started = time.monotonic()
        for ids in prompts:  # interleaved: every server sees the workload in the same order, side by side
            for name, server in servers.items():
                replies[name].append(server.generate(ids))
        seconds = time.monotonic() - started
    finally:
        for server in servers.values():
            server.stop()
        daemons.stop()

    for name, got in replies.items():
        wrong = [i for i, (a, b) in enumerate(zip(got, replies["reference"])) if not same_outputs(a, b)]
        assert not wrong, f"{name}: requests {wrong} answered unlike a server without cache"
    summary = {name: rates(got, prompts) for name, got in replies.items() if name != "reference"}
    summary["workload"] = {"requests": len(prompts), "prompt_tokens": sum(len(p) for p in prompts),
                           "device_pages": DEVICE_TOKENS // PAGE, "host_pages": HOST_PAGES, "tp": TP,
                           "seconds": round(seconds, 1)}
    (tmp_path / "hit-rates.json").write_text(json.dumps(summary, indent=1))
    print("hit rates:", json.dumps(summary))
    assert summary["cpcache"]["hit"] > summary["radix"]["hit"]
    assert summary["cpcache"]["storage"] > 0
    if HICACHE:
        assert summary["cpcache"]["hit"] >= summary["hicache"]["hit"]
