"""SGLang 0.5.23's own radix cache with the `cpcache` backend, on 4 ranks
(attention TP 2 x CP 2): four SGLang processes, each with its own real
daemon, replay a slice of a real trace through the scheduler-facing calls.
Every rank must take the same decisions and load back every KV byte intact;
the hit rates are reported beside SGLang's plain radix cache on the same slice.

Runs in SGLang's own environment (.venv-sglang, built by `make setup`)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.topology import Topology

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = Path(os.environ.get("CPCACHE_SGLANG_PYTHON", ROOT / ".venv-sglang" / "bin" / "python"))
TRACE = ROOT / "traces" / "conversation_trace.jsonl"
WORKER = Path(__file__).resolve().parent / "worker.py"

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(420),
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason=f"SGLang's environment is not built ({SGLANG_PYTHON}); "
                       "`make setup` builds it"),
]


async def run_worker(out: Path, *args: str, env: dict[str, str] | None = None) -> dict:
    proc = await asyncio.create_subprocess_exec(
        str(SGLANG_PYTHON), str(WORKER), "--trace", str(TRACE), "--out", str(out), *args,
        env={**os.environ, **(env or {})}, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    output, _ = await proc.communicate()
    await proc.wait()
    assert proc.returncode == 0, f"worker {args} failed:\n{output.decode()[-4000:]}"
    return json.loads(out.read_text())


def hit_rate(report: dict) -> dict[str, float]:
    served = [r for r in report["records"] if not r.get("aborted")]
    total = sum(r["tokens"] for r in served)
    device = sum(r["device_hit"] for r in served)
    below = sum(r.get("loaded", 0) for r in served)
    return {"requests": len(served), "tokens": total, "device_hit": device / total,
            "host_or_storage_hit": below / total, "hit": (device + below) / total}


async def test_sglang_radix_cache_on_four_ranks_agrees_and_loads_every_byte(run_dir):
    topology = Topology(tp=4, cp=2)  # attention TP 2 x CP 2
    # SGLang's import takes seconds of CPU per process; four of them on a busy
    # machine may reach their (agreed) Attach well apart: a generous timeout.
    spec = DomainSpec(topology, run_dir, agreement_timeout_s=60.0, extra=dict(
        storage="file", storage_root=str(run_dir / "pages"), host_pool_pages=160,
        prefetch_policy="wait_complete", prefetch_threshold_tokens=0))
    async with LocalDomain(spec) as domain:
        workers = []
        for rank, socket in enumerate(domain.sockets):
            config = run_dir / f"sglang-{rank}.json"
            config.write_text(json.dumps({"socket": socket, "model_id": "trace-model", "record_decisions": True,
                                          "timeout_s": 90}))
            coords = topology.coordinates(rank)
            workers.append(run_worker(run_dir / f"report-{rank}.json", "--backend", "cpcache",
                                      "--tp-rank", str(coords.atp), "--atp", str(topology.atp),
                                      "--tp", str(topology.tp), "--cp", str(topology.cp), "--rank", str(rank),
                                      env={"CPCACHE_SGLANG_CONFIG": str(config)}))
        outcomes = await asyncio.gather(*workers, return_exceptions=True)  # every worker ends before any check
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        reports = outcomes
    baseline = await run_worker(run_dir / "report-sglang.json", "--backend", "sglang")

    # The same decisions on every rank: what each request hit, and every agreed reply.
    for rank, report in enumerate(reports[1:], start=1):
        assert report["records"] == reports[0]["records"], f"rank {rank} served the slice differently"
        assert report["decisions"] == reports[0]["decisions"], f"rank {rank} saw other decisions"
    for rank, report in enumerate(reports):
        assert report["wrong_bytes"] == 0, f"rank {rank}: {report['wrong_bytes']} KV bytes loaded wrong"
        assert report["tally"]["load_failures"] == 0 and report["tally"]["write_failures"] == 0
    tally = reports[0]["tally"]
    assert tally["loaded_pages"] > 0, "no request was served from the host or storage tiers"
    assert tally["prefetched_pages"] > 0, "no request was served from storage"
    assert reports[0]["checked_pages"] > 0
    # Write-through covers every computed page (each rank wrote its own shard).
    assert tally["write_acks"] == tally["writes"]

    cpcache_rate, sglang_rate = hit_rate(reports[0]), hit_rate(baseline)
    assert cpcache_rate["hit"] >= sglang_rate["hit"]
    summary = {"cpcache": cpcache_rate, "sglang_radix": sglang_rate, "tally": tally}
    (run_dir / "hit-rates.json").write_text(json.dumps(summary, indent=1))
    print("hit rates:", json.dumps(summary), file=sys.stderr)
