"""`cpcache bench serving`: SGLang's own benchmark client against CP servers.

`python -m sglang.bench_serving --backend sglang --dataset-name mooncake`
replays a Mooncake-format trace (a scaled-down slice of
traces/conversation_trace.jsonl in the repository: the first REQUESTS requests,
their prefix chains cut to BLOCKS blocks, OUTPUT tokens out, arrivals at
their timestamps slowed by SLOWDOWN, `--slowdown`) against real `sglang.launch_server`
servers at `--tp 2 --attn-cp-size 2`, offline on this host, one server at
a time, in the order of CONFIGS (cpcache and SGLang's HiCache alternate):

- `radix`: SGLang's plain radix cache;
- `hicache-host` / `cpcache-host`: a host tier of HOST_PAGES pages;
- `hicache-file` / `cpcache-file`: the same, with file storage beneath;
- `hicache-file-bounded` / `cpcache-file-bounded`: file storage bounded to
  BOUND_PAGES pages' bytes in all (a disk quota: SGLang's `max_size` per
  rank, each CP rank keeping its own copy of every page; cpcache's
  `storage_capacity_bytes` for the root its ranks share, one object per page);
- `hicache-mooncake-bounded` / `cpcache-mooncake-bounded`: Mooncake Store
  beneath, on a `mooncake_master` of its own on loopback, its segments
  BOUND_PAGES pages' bytes in all (each TP rank mounts half: SGLang's
  `global_segment_size`, cpcache's `storage_segment_bytes` per daemon).

The model is a random Qwen3 (`sglang_pd.MODEL`) large enough that a
prefill's compute is most of a miss's TTFT on this CPU, with a word-level
tokenizer saved beside it (the dataset's prompts are text). Reported per
server from bench_serving's own output file: completed and failed requests,
TTFT (mean, median, p99), ITL, TPOT, request and token throughputs, its
cache report (hit rate, device / host / storage tokens); beside them the
CPU seconds the server's processes (and cpcache's daemons) spent, the bytes
each store holds at the end, and a fixed check set of prompts answered
equal to a tp 1 server without cache (tokens, and logprobs within 1e-4).
After the trace each server gets decode-only bursts (DECODE_ONLY: short
random prompts, long answers, sent at once, three bursts in a row; medians): its ITL beside the trace's
(where prefills are admitted beside decodes) tells a decode step's own
cost from what prefills beside it add.

With `--repeat N`, N blocks of every server, the order reversed every
other block and rotated every two (`order_of`: the first server of a run
measures slower), and each pair's ratios per block, their median and
spread (`ratios`: cpcache over HiCache on the same tier, each over radix).

Every server runs with SGLang's `--sleep-on-idle` unless `--spin-when-idle`:
an idle SGLang scheduler otherwise polls in a loop, a core per server at
this load whatever its cache, and the CPU seconds measure mostly that loop.
Waking costs a request nothing (without DP attention, as here): rank 0
sleeps in a poll of the sockets a request arrives by. What is left is not
quite symmetric: SGLang counts HiCache's own I/O in flight as work, so a
HiCache server loops (yielding) until it drains, while a cpcache server,
whose operations SGLang does not see, sleeps with a step in flight and
takes its reply at the next loop.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from cpcache.tools.bench.serving_breakdown import backend_by_rank, per_request, role_cpu
from cpcache.tools.bench.serving_breakdown import table as breakdown_table

if TYPE_CHECKING:
    from cpcache.testing.mooncake_master import MooncakeMaster
    from cpcache.testing.sglang_cpu.servers import Daemons, Server

CONFIGS = ("radix", "cpcache-host", "hicache-host", "cpcache-file", "hicache-file", "cpcache-file-bounded",
           "hicache-file-bounded", "cpcache-mooncake-bounded", "hicache-mooncake-bounded")
TP, CP = 2, 2
PAGE = 16
DEVICE_TOKENS = 2048
HOST_PAGES = 2 * DEVICE_TOKENS // PAGE  # HiCache's --hicache-ratio 2; cpcache's host pool as many
REQUESTS, BLOCKS, OUTPUT, SLOWDOWN = 400, 6, 4, 1.5
BOUND_PAGES = 6144  # the bounded stores hold this many pages' bytes in all
# How a storage prefetch ends (`--prefetch-policy`), the same on both stacks:
# from the first page until every rank has every page, unless told otherwise.
POLICY = "wait_complete"
# Under `timeout`: SGLang's default budget, given to both stacks alike.
TIMEOUT_HICACHE = {"prefetch_timeout_base": 1.0, "prefetch_timeout_per_ki_token": 0.25}
TIMEOUT_CPCACHE = {"prefetch_timeout_base_s": 1.0, "prefetch_timeout_per_ki_token_s": 0.25}
TRACE = Path(__file__).resolve().parents[3] / "traces" / "conversation_trace.jsonl"
_DATASET_WORDS = ["[UNK]", "[EOS]", *"0123456789", "hi", "story", "Round", "Tell", "me", "a", "based", "on", "this",
                  "context", ".", ":", "user", "assistant", "system"]
# Every id the model can answer is a word (the client times a token from its text).
WORDS = [*_DATASET_WORDS, *(f"w{i}" for i in range(len(_DATASET_WORDS), 512))]
CHECKS = 6  # the fixed check set: prompts answered by every server and the reference
# After the trace, a decode-only burst: its ITL beside the trace's (prefills
# admitted beside decodes) tells what a cache costs a decode step alone.
DECODE_ONLY = {"requests": 8, "input_len": 32, "output_len": 64, "bursts": 3}


def scaled_trace(source: Path, out: Path, requests: int = REQUESTS, blocks: int = BLOCKS,
                 output: int = OUTPUT) -> Path:
    """The first `requests` requests of `source`, each prefix chain cut to
    `blocks` blocks and `output` tokens out (timestamps as they are)."""
    rows: list[dict] = []
    with open(source) as fh:
        for line in fh:
            if len(rows) == requests:
                break
            row = json.loads(line)
            row["hash_ids"] = row["hash_ids"][:blocks]
            row["output_length"] = output
            rows.append(row)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def add_tokenizer(model: Path) -> Path:
    """A word-level tokenizer over the dataset's words, digits one by one, saved beside `model`."""
    from cpcache.testing.sglang_cpu.servers import sglang_interpreter

    script = (
        "import json, sys\n"
        "from tokenizers import Tokenizer, models, pre_tokenizers\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "words = json.loads(sys.argv[2])\n"
        "tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token='[UNK]'))\n"
        "tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),\n"
        "    pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.Punctuation()])\n"
        "fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token='[UNK]', eos_token='[EOS]')\n"
        "fast.save_pretrained(sys.argv[1])\n")
    subprocess.run([sglang_interpreter(), "-c", script, str(model), json.dumps(WORDS)], check=True,
                   capture_output=True, timeout=300)
    return model


def page_bytes() -> int:
    """One page's KV bytes on one CP rank (float32, every layer, K and V)."""
    from cpcache.tools.bench.sglang_pd import MODEL

    return int(2 * MODEL["num_hidden_layers"] * MODEL["num_key_value_heads"] * MODEL["head_dim"] * 4 * PAGE)


class Config:
    """One server of the comparison (and its daemons, for cpcache; its
    Mooncake master, for a Mooncake store)."""

    def __init__(self, name: str, work: Path, model: Path, policy: str = POLICY, sleep_on_idle: bool = True) -> None:
        """`policy`: how a storage prefetch ends, on either stack, with the
        same timeout (SGLang's defaults) under `timeout`."""
        from cpcache.testing.mooncake_master import MooncakeMaster

        self.name, self.work = name, work
        work.mkdir(parents=True, exist_ok=True)
        self.store = work / f"{name}-pages" if "file" in name else None
        self.daemons: Daemons | None = None
        self.master = MooncakeMaster(work / f"{name}-master.log").start() if "mooncake" in name else None
        try:
            self.server = self._server(work, model, policy, sleep_on_idle)  # built, not started
        except BaseException:
            if self.master is not None:
                self.master.stop()
            raise

    def _server(self, work: Path, model: Path, policy: str, sleep_on_idle: bool) -> Server:
        from cpcache.testing.sglang_cpu.hicache import (
            HICACHE_ENV,
            HICACHE_FLAGS,
            hicache_file_storage_flags,
            hicache_mooncake_flags,
        )
        from cpcache.testing.sglang_cpu.servers import (
            CPCACHE_FLAGS,
            CPCACHE_HOST_FLAGS,
            Daemons,
            Server,
        )

        name = self.name
        bound = BOUND_PAGES * page_bytes() if name.endswith("bounded") else 0
        env: dict[str, str] = {}
        if name == "radix":
            flags: list[str] = []
        elif name.startswith("hicache"):
            env = dict(HICACHE_ENV)
            if self.master is not None:  # SGLang divides the segment bytes among its TP ranks
                flags = hicache_mooncake_flags(self.master.master, self.master.metadata_server, bound)
            elif self.store is not None:
                flags = [*HICACHE_FLAGS, *hicache_file_storage_flags(self.store)]
            else:
                flags = list(HICACHE_FLAGS)
            if "--hicache-storage-backend" in flags:
                flags[flags.index("--hicache-storage-prefetch-policy") + 1] = policy
                extra = json.loads(flags[-1]) | TIMEOUT_HICACHE
                if bound and self.store is not None:  # per rank: each CP rank keeps its own copy of every page
                    extra["max_size"] = str(bound // CP)
                flags[-1] = json.dumps(extra)
        else:
            settings: dict = dict(host_pool_pages=HOST_PAGES, prefetch_threshold_tokens=0, prefetch_policy=policy,
                                  **TIMEOUT_CPCACHE)
            if self.store is not None:
                settings |= dict(storage="file", storage_root=str(self.store), storage_capacity_bytes=bound)
            if self.master is not None:  # each daemon mounts its share, as each of SGLang's TP ranks does
                settings |= dict(storage="mooncake", storage_master=self.master.master,
                                 storage_metadata_server=self.master.metadata_server,
                                 storage_segment_bytes=bound // TP)
            self.daemons = Daemons(work / f"{name}-run", tp=TP, cp=CP, settings=settings)
            backend = work / f"{name}.json"
            backend.write_text(json.dumps({"socket": str(work / f"{name}-run" / "rank-{rank}.sock"),
                                           "model_id": "bench"}))
            storage = self.store is not None or self.master is not None
            flags = list(CPCACHE_FLAGS if storage else CPCACHE_HOST_FLAGS)
            env = {"CPCACHE_SGLANG_CONFIG": str(backend)}
        return Server(name, model, work, flags, tp=TP, cp=CP, page_size=PAGE, device_tokens=DEVICE_TOKENS,
                      env=env, tokenizer=True, sleep_on_idle=sleep_on_idle)

    def start(self) -> float:
        began = time.monotonic()
        if self.daemons is not None:
            self.daemons.start()
        self.server.start().wait_ready()
        return time.monotonic() - began

    def stop(self) -> None:
        self.server.stop()
        if self.daemons is not None:
            self.daemons.stop()
        if self.master is not None:
            self.master.stop()

    def cpu_by_role(self) -> dict[str, float]:
        """CPU seconds so far of the server's schedulers, the rest of the
        server, its daemons and its Mooncake master (serving_breakdown.py)."""
        launcher = self.daemons.process if self.daemons is not None else None
        return role_cpu(self.server.process.proc.pid if self.server.process else None,
                        launcher.proc.pid if launcher is not None else None,
                        self.master.proc.pid if self.master is not None and self.master.proc is not None else None)

    def daemon_counters(self) -> dict[str, int] | None:
        """Rank 0's daemon counters of where its host pool's pages went (None: no daemons)."""
        from cpcache.client import Client

        if self.daemons is None:
            return None
        with Client(self.daemons.socket(0), timeout_s=10) as daemon:
            stats = daemon.stats()
        return {k: stats.get(k, 0) for k in DAEMON_COUNTERS}

    def flush_lines(self) -> tuple[dict[str, int], dict[int, dict]] | None:
        """Flush the server's cache; a cpcache server's ranks log then:
        -> rank 0's backend side of the lost hits (`integrations/sglang/lost_hits.py`)
        and every rank's backend time (serving_breakdown.py); None: no daemons."""
        process = self.server.process
        if self.daemons is None or process is None:
            if process is not None:
                self.server.flush_cache()
            return None
        count = len(self.server.log_lines(" lost hits: "))
        self.server.flush_cache()
        lines = process.wait_lines(" lost hits: ", count + TP, timeout_s=120)
        line = next(line for line in reversed(lines) if "cpcache: rank 0 lost hits" in line)
        lost = {reason: int(n) for reason, n in re.findall(r"(\w+) (\d+) pages", line.partition(" lost hits: ")[2])}
        return lost, backend_by_rank(self.server.log_lines(" backend: "))

    def stored_bytes(self) -> int | None:
        return stored_bytes(self.master, self.store)


def stored_bytes(master: MooncakeMaster | None, root: Path | None) -> int | None:
    """What a store holds now: a Mooncake master's allocated bytes (None: it
    no longer answers), else the files under `root` (0: none)."""
    if master is not None:
        try:
            return int(master.metrics().get("master_allocated_bytes", 0))
        except OSError:
            return None
    if root is None or not root.exists():
        return 0
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def bench_client(port: int, model: Path, trace: Path, out: Path, requests: int, slowdown: float, rounds: int = 1,
                 details: bool = False) -> dict:
    """SGLang's bench_serving over the trace, `rounds` turns per session
    (each turn's prompt holding the ones before it and a stand-in answer),
    with every request's own figures when `details`: -> its result (the
    output file's last line)."""
    return _bench_serving(port, model, out, ["--dataset-name", "mooncake", "--dataset-path", str(trace),
                                             "--num-prompts", str(requests), "--mooncake-slowdown-factor",
                                             str(slowdown), "--mooncake-num-rounds", str(rounds), "--cache-report",
                                             *(["--output-details"] if details else [])])


def decode_only_client(port: int, model: Path, out: Path) -> dict:
    """DECODE_ONLY's requests sent at once: short prompts of random ids and
    long answers, so that past their first steps every step of the server
    decodes, no prefill beside it: -> bench_serving's result."""
    return _bench_serving(port, model, out, [
        "--dataset-name", "random-ids", "--num-prompts", str(DECODE_ONLY["requests"]),
        "--random-input-len", str(DECODE_ONLY["input_len"]), "--random-output-len", str(DECODE_ONLY["output_len"]),
        "--random-range-ratio", "1", "--request-rate", "inf", "--seed", "7"])


def decode_only(port: int, model: Path, out: Path) -> dict:
    """The decode-only bursts' figures (DECODE_ONLY["bursts"] of them, one
    after the other: each figure the median over the bursts, and each
    burst's mean ITL), with their failed requests; a burst that could not
    run says why and leaves the trace's figures standing."""
    results = []
    for burst in range(DECODE_ONLY["bursts"]):
        try:
            results.append(decode_only_client(port, model, out.with_suffix(f".{burst}.jsonl")))
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
            return {"error": str(exc)[-500:], "bursts_done": burst}
    figures = {f: statistics.median(r[f] for r in results) if all(r.get(f) is not None for r in results) else None
               for f in DECODE_FIGURES}
    return {**figures, "bursts_mean_itl_ms": [r.get("mean_itl_ms") for r in results],
            "failed": DECODE_ONLY["requests"] * len(results) - sum(r.get("completed") or 0 for r in results)}


def _bench_serving(port: int, model: Path, out: Path, workload: list[str]) -> dict:
    from cpcache.testing.sglang_cpu.servers import CPU_HOST, sglang_interpreter

    env = {**os.environ, "PYTHONPATH": str(CPU_HOST)}
    done = subprocess.run([sglang_interpreter(), "-m", "sglang.bench_serving", "--backend", "sglang",
                           "--host", "127.0.0.1", "--port", str(port), "--model", str(model),
                           "--tokenizer", str(model), *workload, "--disable-tqdm", "--output-file", str(out)],
                          capture_output=True, text=True, env=env, timeout=3600, check=False)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"bench serving: sglang.bench_serving failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(out.read_text().strip().splitlines()[-1])


# What became of the pages a daemon was asked to hold: hits, and the ways of losing them
# (docs/operations.md, "Why a hit was lost": asked = storage hits + resident + the lost pages but host_evicted).
LOST_REASONS = ("storage_miss", "below_threshold", "host_full", "revoked", "prefetch_late", "read_failed",
                "host_evicted")
DAEMON_COUNTERS = ("storage_hit_pages", "host_hit_pages", "prefetched_pages_evicted_unloaded",
                   "writes_refused_host_full", "prefetch_holds_expired", "prefetch_asked_pages",
                   "prefetch_resident_pages", "prefetches_short", *(f"lost_hit_pages_{r}" for r in LOST_REASONS))
FIGURES = ("completed", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "median_itl_ms",
           "mean_tpot_ms", "request_throughput", "input_throughput", "output_throughput")
DECODE_FIGURES = ("completed", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_tpot_ms", "output_throughput")


def check_prompts(trace: Path) -> list[list[int]]:
    """The fixed check set: a few prompts of digit tokens, 40 per block of the trace's first requests."""
    rows = [json.loads(line) for line in trace.read_text().splitlines()[:CHECKS]]
    return [[2 + (h * 7 + i) % 10 for i in range(len(r["hash_ids"]) * 40)] for h, r in enumerate(rows)]


def run(work: Path, configs: tuple[str, ...] = CONFIGS, requests: int = REQUESTS, slowdown: float = SLOWDOWN,
        policy: str = POLICY, sleep_on_idle: bool = True, repeat: int = 1) -> dict:
    """`repeat` blocks of every server in `order_of`'s order (ratios then
    per block: `report["ratios"]`)."""
    from cpcache.testing.sglang_cpu.servers import PLAIN_FLAGS, Server
    from cpcache.tools.bench.sglang_pd import MODEL, make_model

    model = add_tokenizer(make_model(work / "model"))
    trace = scaled_trace(TRACE, work / "trace.jsonl", requests=requests)
    checks = check_prompts(trace)
    reference = Server("reference", model, work, PLAIN_FLAGS, tp=1, page_size=PAGE, device_tokens=DEVICE_TOKENS,
                       tokenizer=True, sleep_on_idle=True).start().wait_ready()
    try:
        expected = [reference.generate(ids) for ids in checks]
    finally:
        reference.stop()
    report: dict = {"servers": {}, "workload": {
        "trace": f"{TRACE.name}: first {requests} requests, prefix chains cut to {BLOCKS} blocks, {OUTPUT} "
                 f"tokens out, arrivals x{slowdown}", "topology": f"--tp {TP} --attn-cp-size {CP}",
        "model": f"random Qwen3 {MODEL}, float32, SGLang's CPU path", "page_size": PAGE,
        "device_pages": DEVICE_TOKENS // PAGE, "host_pages": HOST_PAGES, "prefetch_policy": policy,
        "idle_schedulers": "sleep (--sleep-on-idle)" if sleep_on_idle else "spin (SGLang's default)",
        "bounded_store_bytes": BOUND_PAGES * page_bytes(), "blocks": repeat,
        "order": "reversed every other block, rotated every two" if repeat > 1 else "as given"}}
    blocks: list[dict[str, dict]] = []
    for block in range(repeat):
        rows: dict[str, dict] = {}
        for name in order_of(block, configs):
            rows[name] = measure(Config(name, work / f"block{block}" if repeat > 1 else work, model, policy,
                                        sleep_on_idle), model, trace, checks, expected, requests, slowdown)
            # Each block's rows under their own names (the first block's as they are).
            report["servers"][name if block == 0 else f"{name}@{block}"] = rows[name]
            print(f"{name} (block {block}): {json.dumps(rows[name])}", file=sys.stderr, flush=True)
        blocks.append(rows)
    if repeat > 1:
        report["ratios"] = ratios(blocks, configs)
    return report


def measure(config: Config, model: Path, trace: Path, checks: list[list[int]], expected: list, requests: int,
            slowdown: float) -> dict:
    """One server through the trace, its check set and its decode-only
    bursts, stopped at the end: -> its row of the report."""
    from cpcache.testing.sglang_cpu.servers import same_outputs

    name, work = config.name, config.work
    try:
        healthy_s = config.start()
        # Every server flushed alike at its start; a cpcache server's
        # backend line then is where the breakdown's window begins.
        flushed = config.flush_lines()
        cpu_before = config.cpu_by_role()
        result = bench_client(config.server.port, model, trace, work / f"{name}-bench.jsonl", requests, slowdown)
        cpu_after = config.cpu_by_role()
        answers = [config.server.generate(ids) for ids in checks]
        wrong = [i for i, (a, b) in enumerate(zip(answers, expected)) if not same_outputs(a, b)]
        row = {f: result.get(f) for f in FIGURES}
        completed = result.get("completed") or 0
        cpu_end = config.cpu_by_role()
        stored, counters, after = config.stored_bytes(), config.daemon_counters(), config.flush_lines()
        row |= {"failed": requests - completed, "cache": result.get("cache_report"),
                "cpu_s": round(sum(cpu_after.values()) - sum(cpu_before.values()), 1),
                "daemons_cpu_s": round(cpu_after["daemons"] - cpu_before["daemons"], 1),
                "stored_bytes": stored, "healthy_s": round(healthy_s, 1), "daemon": counters,
                "backend_lost": after[0] if after else None,
                # From the flush at the start to the one at the end: the
                # trace's requests, bench_serving's warmup one, the checks.
                "per_request": per_request(cpu_before, cpu_end, requests + 1 + len(checks),
                                           flushed[1] if flushed else None, after[1] if after else None),
                "checks_equal": f"{len(checks) - len(wrong)}/{len(checks)}"}
        # Last, after every figure of the trace was read: the burst's pages
        # would count in the stores and the daemons' counters.
        row["decode_only"] = decode_only(config.server.port, model, work / f"{name}-decode-only.jsonl")
        return row
    finally:
        config.stop()


def order_of(block: int, configs: tuple[str, ...]) -> tuple[str, ...]:
    """The servers' order in block `block`: every other block the reverse of
    the one before, so each pair runs in both orders every two blocks, and
    rotated every two blocks, so no server is always first (the first server
    of a run measures slower). Blocks 0-3 of two servers: AB, BA, BA, AB."""
    k = (block // 2) % len(configs)
    order = configs[k:] + configs[:k]
    return order if block % 2 == 0 else order[::-1]


# The figures compared pair by pair, block by block (`--repeat`).
RATIO_FIGURES = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "hit_rate_pct", "cpu_s",
                 "schedulers_cpu_ms", "decode_only_itl_ms")


def _figure(row: dict, key: str) -> float | None:
    if key == "hit_rate_pct":
        return (row.get("cache") or {}).get("cache_hit_rate_pct")
    if key == "schedulers_cpu_ms":
        return ((row.get("per_request") or {}).get("cpu_ms") or {}).get("schedulers")
    if key == "decode_only_itl_ms":
        return (row.get("decode_only") or {}).get("median_itl_ms")
    return row.get(key)


def ratios(blocks: list[dict[str, dict]], configs: tuple[str, ...]) -> dict:
    """cpcache over HiCache on the same tier, and each over radix: per block,
    then the median and spread over the blocks (`block_summary`)."""
    from cpcache.testing.stats import block_summary

    pairs = [(c, "hicache" + c.removeprefix("cpcache")) for c in configs if c.startswith("cpcache")]
    pairs += [(c, "radix") for c in configs if c != "radix"]
    out: dict = {}
    for num, den in pairs:
        if num not in configs or den not in configs:
            continue
        figures = {}
        for key in RATIO_FIGURES:
            values = [(_figure(b[num], key), _figure(b[den], key)) for b in blocks]
            found = [n / d for n, d in values if n is not None and d]
            if found:  # a figure no block has is left out (no NaN in the JSON)
                figures[key] = block_summary(found)
        out[f"{num} / {den}"] = figures
    return out


def ratio_table(report: dict) -> list[str]:
    """The pairs' ratios, median over the blocks [min, max]."""
    if not report.get("ratios"):
        return []
    lines = ["| ratio, median over blocks [min-max] | " + " | ".join(RATIO_FIGURES) + " |",
             "|---|" + "---:|" * len(RATIO_FIGURES)]
    for pair, figures in report["ratios"].items():
        cells = [f"{f['median']:.2f} [{f['spread']['min']:.2f}-{f['spread']['max']:.2f}]" if f else "-"
                 for f in (figures.get(k) for k in RATIO_FIGURES)]
        lines.append(f"| {pair} | " + " | ".join(cells) + " |")
    return lines


def table(report: dict) -> list[str]:
    lines = ["| server | done | TTFT mean | median | p99 | ITL mean | decode-only ITL | TPOT mean | in tok/s | hit % "
             "| device | host | storage | stored MB | CPU s (daemons) | checks |", "|---|" + "---:|" * 15]
    for name, r in report["servers"].items():
        c = r.get("cache") or {}
        stored = "-" if r["stored_bytes"] is None else f"{r['stored_bytes'] / 1e6:.1f}"
        lines.append(f"| {name} | {r['completed']} | {r['mean_ttft_ms']:.0f} | {r['median_ttft_ms']:.0f} | "
                     f"{r['p99_ttft_ms']:.0f} | {r['mean_itl_ms']:.1f} | "
                     f"{decode_itl(r)} | {r.get('mean_tpot_ms') or 0:.1f} | "
                     f"{r['input_throughput']:.0f} | "
                     f"{c.get('cache_hit_rate_pct', 0):.2f} | {c.get('device_cached_tokens') or 0} | "
                     f"{c.get('host_cached_tokens') or 0} | {c.get('storage_cached_tokens') or 0} | "
                     f"{stored} | {r['cpu_s']} ({r.get('daemons_cpu_s', '-')}) | {r['checks_equal']} |")
    return lines


def decode_itl(row: dict) -> str:
    """The burst's mean ITL as the table shows it: '-' where it did not run."""
    itl = (row.get("decode_only") or {}).get("mean_itl_ms")
    return "-" if itl is None else f"{itl:.1f}"


def main(args: argparse.Namespace) -> int:
    keep = getattr(args, "work_dir", None)
    configs = tuple(c for c in (getattr(args, "configs", None) or ",".join(CONFIGS)).split(","))
    requests = getattr(args, "trace_requests", None) or REQUESTS
    slowdown = getattr(args, "slowdown", None) or SLOWDOWN
    policy = getattr(args, "prefetch_policy", None) or POLICY
    sleep_on_idle = not getattr(args, "spin_when_idle", False)
    repeat = getattr(args, "repeat", None)
    repeat = 1 if repeat is None else repeat
    if repeat < 1:
        print("cpcache bench serving: --repeat must be at least 1 (blocks of every server)", file=sys.stderr)
        return 2
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        report = run(Path(keep), configs, requests, slowdown, policy, sleep_on_idle, repeat)
    else:
        with tempfile.TemporaryDirectory(prefix="cpc-serving-") as tmp:
            report = run(Path(tmp), configs, requests, slowdown, policy, sleep_on_idle, repeat)
    print(json.dumps(report) if args.json else "\n".join([*table(report), "", *breakdown_table(report), "",
                                                            *ratio_table(report)]))
    return 0
