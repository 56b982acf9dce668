"""`cpcache bench serving-pd`: SGLang's own benchmark client through
SGLang's router in front of a prefill/decode pair, the seed's shape.

`python -m sglang.bench_serving --backend sglang --dataset-name mooncake
--mooncake-num-rounds ROUNDS` replays the first SESSIONS sessions of
traces/conversation_trace.jsonl (prefix chains cut to BLOCKS blocks,
OUTPUT tokens out), each session ROUNDS turns whose prompts hold the turns
before them and a stand-in answer, against
`sglang_router.launch_router --pd-disaggregation` in front of a prefill
server at `--tp 2 --attn-cp-size 2` and a decode server at tp 1
(cpcache/testing/sglang_cpu/pd.py). One pair at a time, the pairs' order
reversed every other block and rotated every two (`serving.order_of`; `--repeat` blocks):

- `radix`: SGLang's plain radix cache on the prefill server;
- `hicache-file` / `hicache-mooncake`: SGLang's HiCache (HOST_PAGES host
  pages) with its `file` or Mooncake Store storage, the decode server
  offloading what it generates into the same storage with SGLang's own
  decode offload;
- `cpcache-file` / `cpcache-mooncake`: the prefill over cpcache daemons
  (as many host pages, the same store), the decode server offloading into
  cpcache's store (`storage.CpcacheStore`).

Mooncake Store is bounded alike: BOUND_PAGES pages' bytes in all (cpcache's
daemons mount them; under HiCache the prefill's TP ranks mount 7/8 and its
decode server 1/8, as SGLang's client cannot write without a segment of
its own); files are not bounded.
Per pair and block: TTFT over the first turns and over the later ones (from
bench_serving's per-request output, `--output-details`), ITL and TPOT,
request and token throughput, hits per tier (its `--cache-report`), the
CPU seconds of every process (the servers', the router's, the daemons' and
the master's), the bytes the store holds, and a fixed check set answered
equal to a tp 1 server without cache. Per request: the CPU of every
process, the daemons' alone, and the cpcache backend's own time on the
prefill's rank 0 scheduler thread (what it logs at a flush). Ratios per block, median over blocks.

The same model and trace as `cpcache bench serving` (a random Qwen3 with a
word-level tokenizer; `--sleep-on-idle` on every server).

What SGLang's client makes of a session: it sends all its turns at the
session's arrival, one right after the other, without waiting for answers,
and each later turn holds a stand-in answer ("story" repeated), not the one
generated. A later turn hits its earlier turns' prompt only once their
prefill has run, and never what a decode server offloaded (its pages are
of the generated answer): under this client the decode offload is a cost,
not a hit. `cpcache bench sglang-pd` sends turns in sequence with the real
answers.

Where HiCache's decode offload fails, its pair runs without it from that
block on (said in the report's notes, the work directory kept): the
cpcache / HiCache ratios of the blocks before and after compare different
decode servers.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cpcache.tools.bench.serving import (
    TRACE,
    add_tokenizer,
    bench_client,
    check_prompts,
    order_of,
    page_bytes,
    scaled_trace,
    stored_bytes,
)
from cpcache.tools.bench.serving_pd_report import summarize, table
from cpcache.tools.bench.sglang import cpu_seconds, descendants, proc_stats

if TYPE_CHECKING:
    from cpcache.testing.mooncake_master import MooncakeMaster
    from cpcache.testing.sglang_cpu.pd import PdDeployment
    from cpcache.testing.sglang_cpu.servers import Reply

CONFIGS = ("radix", "hicache-file", "cpcache-file", "hicache-mooncake", "cpcache-mooncake")
TP, CP = 2, 2  # the prefill server's; the decode server runs at tp 1
PAGE = 16
DEVICE_TOKENS = 2048  # the prefill's device pool
HOST_PAGES = 2 * DEVICE_TOKENS // PAGE
DECODE_TOKENS = 16384
SESSIONS, ROUNDS, BLOCKS, OUTPUT, SLOWDOWN = 40, 3, 3, 16, 3.0
BOUND_PAGES = 6144
DECODE_SEGMENT_SHARE = 8  # HiCache's decode server mounts 1/8 of a bounded Mooncake Store
FIGURES = ("completed", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "median_itl_ms",
           "mean_tpot_ms", "request_throughput", "input_throughput", "output_throughput")
BACKEND_MARK = " backend: "  # the backend's time line, per rank at a flush (integrations/sglang/timing.py)
TIERS = ("device_cached_tokens", "host_cached_tokens", "storage_cached_tokens")
# SGLang's decode log line, every `--decode-log-interval` (40) decode iterations.
DECODE_LINE = re.compile(r"Decode batch( \[\d+\])?, #running-req: (\d+),")


def decode_flags() -> list[str]:
    """Both pairs' decode server: a pool for the longest turns of the
    sessions at once, OUTPUT tokens reserved per request."""
    return ["--max-total-tokens", str(DECODE_TOKENS), "--num-reserved-decode-tokens", str(OUTPUT)]


def decode_batch_mean(lines: list[str]) -> float | None:
    """The decode server's mean running requests over its decode log lines:
    ITL grows with the batch a decode iteration serves, so a pair that
    prefills sooner (more turns decoding at once) shows a longer ITL. A
    line comes every 40 decode iterations: a block of this bench gives a
    few (`decode_batch_lines` says how many)."""
    sizes = [int(m[2]) for line in lines if (m := DECODE_LINE.search(line))]
    return round(statistics.fmean(sizes), 2) if sizes else None


def turn_ttfts(ttfts: list[float], rounds: int, errors: list[str] | None = None) -> dict[str, float]:
    """Mean and median TTFT (ms) of the first turns and of the later ones,
    over the requests that did not fail (`errors`, bench_serving's per
    request: a failed one's TTFT is 0). Its output lists requests in the
    order it made them, a session's turns in a row: request i is turn
    i % rounds."""
    out: dict[str, float] = {}
    ok = [not (errors[i] if errors and i < len(errors) else "") for i in range(len(ttfts))]
    for part, chosen in (("first", [t for i, t in enumerate(ttfts) if ok[i] and i % rounds == 0]),
                         ("later", [t for i, t in enumerate(ttfts) if ok[i] and i % rounds])):
        if chosen:
            out[f"ttft_{part}_mean_ms"] = round(statistics.mean(chosen) * 1e3, 1)
            out[f"ttft_{part}_median_ms"] = round(statistics.median(chosen) * 1e3, 1)
    return out


class Pair:
    """One PD pair of the comparison, with its store (a Mooncake master of
    its own, or a directory) and, for cpcache, its daemons."""

    def __init__(self, name: str, work: Path, model: Path, decode_offload: bool = True) -> None:
        from cpcache.testing.mooncake_master import MooncakeMaster

        self.name, self.work = name, work
        work.mkdir(parents=True, exist_ok=True)
        self.root = work / "pages" if name.endswith("file") else None
        self.master: MooncakeMaster | None = (MooncakeMaster(work / "master.log").start()
                                              if name.endswith("mooncake") else None)
        try:
            self.pd = self._deployment(model, decode_offload)
        except BaseException:
            self.stop()
            raise

    def _deployment(self, model: Path, decode_offload: bool) -> PdDeployment:
        from cpcache.testing.sglang_cpu.hicache import (
            HICACHE_ENV,
            HICACHE_FLAGS,
            hicache_file_storage_flags,
            hicache_host_flags,
            hicache_mooncake_flags,
        )
        from cpcache.testing.sglang_cpu.pd import PdDeployment, over_cpcache

        bound = BOUND_PAGES * page_bytes()
        options: dict[str, Any] = dict(page_size=PAGE, device_tokens=DEVICE_TOKENS, decode_flags=decode_flags(),
                                       server_options=dict(tokenizer=True, sleep_on_idle=True))
        if self.name == "radix":
            return PdDeployment(self.work, model, prefill_tp=TP, prefill_cp=CP, **options)
        if self.name.startswith("cpcache"):
            storage: dict[str, Any] = dict(storage="file", storage_root=str(self.root))
            if self.master is not None:
                storage = dict(storage="mooncake", storage_master=self.master.master,
                               storage_metadata_server=self.master.metadata_server,
                               storage_segment_bytes=bound // TP)
            return over_cpcache(self.work, model, tp=TP, cp=CP, host_pages=HOST_PAGES, storage=storage,
                                decode_offload=decode_offload, **options)
        host = hicache_host_flags(HOST_PAGES, PAGE, DEVICE_TOKENS)  # as many host pages as cpcache's
        if self.master is not None:
            # The decode server's offload into the same store mounts a share
            # of it (SGLang's client puts a page at its start, failing without
            # a segment of its own); the prefill's TP ranks mount the rest.
            decode_share = bound // DECODE_SEGMENT_SHARE if decode_offload else 0
            prefill = hicache_mooncake_flags(self.master.master, self.master.metadata_server, bound - decode_share)
            prefill[prefill.index("--hicache-ratio") + 1] = host[host.index("--hicache-ratio") + 1]
            decode_storage = hicache_mooncake_flags(self.master.master, self.master.metadata_server, decode_share)
            decode_storage = decode_storage[len(HICACHE_FLAGS):]
            layout = "page_first_direct"
        else:
            assert self.root is not None
            prefill = [*host, *hicache_file_storage_flags(self.root)]
            decode_storage = hicache_file_storage_flags(self.root)
            layout = "layer_first"
        decode = list(decode_flags())
        if decode_offload:  # SGLang's own offload of the decode server's pages
            decode += ["--disaggregation-decode-enable-offload-kvcache", *decode_storage,
                       "--hicache-io-backend", "direct", "--hicache-mem-layout", layout]
        options["decode_flags"] = decode
        return PdDeployment(self.work, model, prefill_tp=TP, prefill_cp=CP, prefill_flags=prefill,
                            prefill_env=dict(HICACHE_ENV), decode_env=dict(HICACHE_ENV), **options)

    def start(self) -> float:
        self.pd.start().wait_ready(timeout_s=900)
        return self.pd.ready_s["all"]

    def stop(self) -> None:
        try:
            if getattr(self, "pd", None) is not None:
                self.pd.stop()
        finally:
            if self.master is not None:
                self.master.stop()

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far of each part: the servers, the router, the daemons, the master."""
        pd = self.pd
        parts = {"prefill": pd.prefill.process if pd.prefill else None,
                 "decode": pd.decode.process if pd.decode else None, "router": pd.router,
                 "daemons": pd.daemons.process if pd.daemons else None}
        stats = proc_stats()
        out = {name: cpu_seconds(stats, set(), descendants(stats, {p.proc.pid}))
               for name, p in parts.items() if p is not None}
        if self.master is not None:  # the master and its metadata server
            out["master"] = cpu_seconds(stats, set(), set(self.master.pids()))
        return out

    def stored_bytes(self) -> int | None:
        return stored_bytes(self.master, self.root)

    def generate(self, ids: list[int]) -> Reply:
        return self.pd.generate(ids)

    def decode_lines(self) -> list[str]:
        """The decode server's decode log lines so far."""
        decode = self.pd.decode
        return decode.log_lines("Decode batch") if decode is not None and decode.process is not None else []

    def flush(self) -> dict | None:
        """Flush the prefill server's cache (every pair alike); -> the cpcache
        backend's own time so far on its rank 0 scheduler thread, as it logs
        it at a flush (None: not over cpcache)."""
        from cpcache.tools.bench.sglang_backend import backend_lines

        prefill = self.pd.prefill
        assert prefill is not None and prefill.process is not None
        count = len(prefill.log_lines(BACKEND_MARK))
        prefill.flush_cache()
        if self.pd.daemons is None:
            return None
        return backend_lines(prefill.process.wait_lines(BACKEND_MARK, count + TP, timeout_s=120)).get(0)


def measure(pair: Pair, model: Path, trace: Path, checks: list[list[int]], expected: list[Reply],
            sessions: int, rounds: int, slowdown: float) -> dict:
    """Start the pair, run bench_serving through its router, check, stop: -> its figures."""
    from cpcache.testing.sglang_cpu.servers import same_outputs

    try:
        healthy_s = pair.start()
        backend_before = pair.flush()
        before = pair.cpu_seconds()
        decode_logged = len(pair.decode_lines())
        result = bench_client(pair.pd.router_port, model, trace, pair.work / "bench.jsonl", sessions, slowdown,
                              rounds=rounds, details=True)
        after = pair.cpu_seconds()
        decode_lines = pair.decode_lines()[decode_logged:]
        stored = pair.stored_bytes()  # before the flush, which cancels writes not yet under way
        backend_after = pair.flush()
        answers = [pair.generate(ids) for ids in checks]
    finally:
        pair.stop()
    cache = result.get("cache_report") or {}
    cpu = {name: round(after[name] - before.get(name, 0.0), 1) for name in after}
    row = {f: result.get(f) for f in FIGURES} | turn_ttfts(result.get("ttfts") or [], rounds, result.get("errors"))
    row |= {"failed": sessions * rounds - (result.get("completed") or 0),
            "hit_rate_pct": cache.get("cache_hit_rate_pct"), **{t: cache.get(t) or 0 for t in TIERS},
            "decode_batch_mean": decode_batch_mean(decode_lines),
            "decode_batch_lines": sum(bool(DECODE_LINE.search(line)) for line in decode_lines),
            "cpu_s": round(sum(cpu.values()), 1), "daemons_cpu_s": cpu.get("daemons", 0.0), "cpu_by_process": cpu,
            "stored_bytes": stored,
            "healthy_s": round(healthy_s, 1),
            "checks_equal": sum(same_outputs(a, b) for a, b in zip(answers, expected))}
    return row | per_request(row, cpu, backend_before, backend_after)


def per_request(row: dict, cpu: dict[str, float], before: dict | None, after: dict | None) -> dict:
    """What a request cost: CPU ms of every process, and for cpcache the
    backend's ms on the prefill's rank 0 scheduler thread (its hooks and
    calls) and its steps' time (the flush's own drain included: it can
    pass the hooks' time) and the daemons' CPU ms."""
    done = row.get("completed") or 0
    if not done:
        return {}
    out = {"cpu_ms_per_request": round(sum(cpu.values()) / done * 1e3, 1),
           "daemons_cpu_ms_per_request": round(cpu.get("daemons", 0.0) / done * 1e3, 1)}
    if before is not None and after is not None:
        backend_s = (after["hook_s"] + after["calls_s"]) - (before["hook_s"] + before["calls_s"])
        out["backend_ms_per_request"] = round(backend_s / done * 1e3, 2)
        out["backend_step_ms_per_request"] = round((after["step_s"] - before["step_s"]) / done * 1e3, 2)
    return out


def run(work: Path, configs: tuple[str, ...], repeat: int, sessions: int, rounds: int, slowdown: float) -> dict:
    from cpcache.testing.sglang_cpu.servers import PLAIN_FLAGS, Server
    from cpcache.tools.bench.sglang_pd import MODEL, make_model

    model = add_tokenizer(make_model(work / "model"))
    trace = scaled_trace(TRACE, work / "trace.jsonl", requests=sessions, blocks=BLOCKS, output=OUTPUT)
    checks = check_prompts(trace)
    reference = Server("reference", model, work, PLAIN_FLAGS, tp=1, page_size=PAGE, device_tokens=DEVICE_TOKENS,
                       tokenizer=True, sleep_on_idle=True).start().wait_ready()
    try:
        expected = [reference.generate(ids) for ids in checks]
    finally:
        reference.stop()
    setup = {"prefill": f"--tp {TP} --attn-cp-size {CP}, {DEVICE_TOKENS} device tokens, {HOST_PAGES} host pages",
             "decode": f"tp 1, {DECODE_TOKENS} tokens", "router": "sglang_router --pd-disaggregation --mini-lb",
             "trace": f"{TRACE.name}: first {sessions} sessions x {rounds} rounds, prefix chains cut to {BLOCKS} "
                      f"blocks, {OUTPUT} tokens out, arrivals x{slowdown}",
             "model": f"random Qwen3 {MODEL}, float32, SGLang's CPU path", "page_size": PAGE,
             "mooncake_bound_bytes": BOUND_PAGES * page_bytes(), "checks": len(checks), "blocks": repeat}
    notes: list[str] = []
    offload = {c: True for c in configs}
    blocks: list[dict[str, dict]] = []
    for i in range(repeat):
        block: dict[str, dict] = {}
        for name in order_of(i, configs):
            place = work / f"block{i}-{name}"
            try:
                block[name] = measure(Pair(name, place, model, offload[name]), model, trace, checks, expected,
                                      sessions, rounds, slowdown)
            except Exception as exc:
                if not name.startswith("hicache") or not offload[name]:
                    raise
                offload[name] = False  # SGLang's decode offload failed: the pair without it, said
                notes.append(f"{name}: SGLang's decode offload failed ({type(exc).__name__}: {str(exc)[-300:]}; "
                             f"logs in {place}); its decode server runs without offload from block {i} on")
                block[name] = measure(Pair(name, work / f"{place.name}-no-offload", model, False), model, trace,
                                      checks, expected, sessions, rounds, slowdown)
            print(f"block {i} {name}: {json.dumps(block[name])}", file=sys.stderr, flush=True)
        blocks.append(block)
    return summarize(blocks, configs, notes, setup)


def main(args: argparse.Namespace) -> int:
    from cpcache.testing.sglang_cpu.servers import SGLANG_PYTHON

    if not SGLANG_PYTHON.exists():
        print(f"cpcache bench serving-pd: SGLang's environment is not built ({SGLANG_PYTHON} is missing): "
              "`make setup` builds .venv-sglang (or set CPCACHE_SGLANG_PYTHON).", file=sys.stderr)
        return 1
    configs = tuple((args.configs or ",".join(CONFIGS)).split(","))
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        print(f"cpcache bench serving-pd: unknown pairs {unknown}; known: {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    sessions = args.sessions
    if args.rounds < 2:
        print("cpcache bench serving-pd: --rounds must be at least 2 (the later turns are what it compares)",
              file=sys.stderr)
        return 2
    keep = Path(args.work_dir) if args.work_dir else None
    work = keep or Path(tempfile.mkdtemp(prefix="cpcache-bench-serving-pd-"))
    started = time.monotonic()
    ok = False
    try:
        report = run(work, configs, args.repeat, sessions, args.rounds, args.slowdown)
        report["wall_s"] = round(time.monotonic() - started, 1)
        ok = not report["notes"]  # a pair that fell back keeps its logs
    finally:
        if ok and keep is None:
            shutil.rmtree(work, ignore_errors=True)
        elif not ok:
            print(f"cpcache bench serving-pd: logs kept in {work}", file=sys.stderr)
    print(json.dumps(report) if args.json else "\n".join(table(report)))
    return 0
