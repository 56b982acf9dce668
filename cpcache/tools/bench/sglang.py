"""`cpcache bench sglang`: what each cache costs a decoding SGLang server.

Real SGLang servers on this machine (`python -m sglang.launch_server`, the
SGLang suite's tiny random Llama, tp 2, SGLang's CPU path; see
cpcache/testing/sglang_cpu), all started at once and kept up for the whole run:

- `radix`: SGLang's plain radix cache;
- `hicache`: SGLang's own HiCache, host memory tier (twice the device pool);
- `cpcache`: the cpcache backend over `cpcache launch` daemons (one per
  rank), host tier only (a host pool of the same pages, no storage), as
  `--radix-cache-backend cpcache` with the flags of docs/sglang.md.

An idle SGLang server's scheduler loops spin (a whole core per tp-2 server
here), so the servers not being measured are paused (SIGSTOP of their
process group) and each block measures one server alone on the machine; the
cpcache daemons stay up. A block is, for each server in turn (radix,
hicache, cpcache): `/flush_cache`, then `--waves` waves of `--requests`
concurrent streamed requests, each a shared prefix and a suffix of its own,
`--new-tokens` tokens out (ignore_eos). Every server gets the same requests
within a block; each block has new suffixes. The blocks are interleaved
after one warm-up block, the servers' order rotating every block (radix,
hicache, cpcache; hicache, cpcache, radix; cpcache, radix, hicache; ...).

Per block and server: TPOT (inter-token time from the streamed chunks: the
time from a request's first token to its last over the tokens between, the
median over the block's requests), output throughput (tokens out over the
block's wall time), TTFT, and the CPU time the server's processes (for
cpcache, its daemons too) spent per output token, from /proc: work done,
which the machine's load moves much less than wall time. Ratios are taken per block (cpcache/radix,
cpcache/hicache) and reported as the median over the blocks with their
spread. The cpcache backend's own time on the scheduler thread comes from
the line each rank logs at `/flush_cache` (`SchedulerTime`, cumulative):
the difference of the lines around a block.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cpcache.testing.stats import block_summary
from cpcache.tools.bench.sglang_backend import BACKEND_NOTE, backend_delta, backend_lines, backend_summary

SERVERS = ("radix", "hicache", "cpcache")
TP = 2
PAGE = 16
DEVICE_TOKENS = 2048  # 128 pages: a block's requests never evict
HOST_PAGES = 2 * DEVICE_TOKENS // PAGE  # HiCache's ratio 2; cpcache's host pool holds as many pages
PREFIX = 256  # tokens shared by every request of a block
SUFFIX = 32  # tokens of each request's own
VOCAB = 500  # the tiny model's vocabulary is 512
TARGETS = {"tpot_cpcache_over_hicache": 1.0, "tpot_cpcache_over_radix": 1.10}
MODE = ("all servers up at once; during each block only the measured server runs, the others paused "
        "(SIGSTOP), since an idle SGLang server's loops spin; the servers' order rotates every block")


# -- pure parts: streamed chunks, the backend's lines, ratios ---------------------------------------------------


def sse_events(lines: Iterable[bytes | str]) -> Iterator[dict]:
    """The JSON objects of a server-sent event stream (`data: {...}` lines,
    up to `data: [DONE]`)."""
    for raw in lines:
        line = raw.decode() if isinstance(raw, bytes) else raw
        line = line.strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


@dataclass
class Stream:
    """One streamed request: when each chunk arrived and the tokens out so far."""

    sent: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (perf_counter, completion tokens so far)
    output_ids: list[int] = field(default_factory=list)
    meta: dict = field(default_factory=dict)  # the last chunk's meta_info (cached tokens per tier, ...)

    def add(self, at: float, chunk: dict) -> None:
        meta = chunk.get("meta_info") or {}
        self.meta = meta or self.meta
        ids = list(chunk.get("output_ids") or [])
        tokens = int(meta.get("completion_tokens", len(self.output_ids) + len(ids)))
        # SGLang streams either every token so far or only the new ones: keep
        # the ids whole. A gateway's last chunk may repeat the last token.
        if len(ids) == tokens:
            self.output_ids = ids
        elif tokens > len(self.output_ids):
            self.output_ids.extend(ids)
        if not self.arrivals or tokens > self.arrivals[-1][1]:
            self.arrivals.append((at, tokens))

    @property
    def tokens(self) -> int:
        return self.arrivals[-1][1] if self.arrivals else 0

    def ttft(self) -> float:
        return self.arrivals[0][0] - self.sent

    def tpot(self) -> float | None:
        """Seconds per output token after the first: (last - first arrival)
        / (tokens between them); None with fewer than two tokens."""
        if len(self.arrivals) < 2:
            return None
        (t0, n0), (t1, n1) = self.arrivals[0], self.arrivals[-1]
        return (t1 - t0) / (n1 - n0)


def block_ratios(blocks: list[dict[str, dict]], figure: str, num: str, den: str) -> dict:
    """`figure` of server `num` over server `den`, per block: median and spread."""
    return block_summary([b[num][figure] / b[den][figure] for b in blocks if b[den][figure]])


def order_of(block: int) -> tuple[str, ...]:
    """The servers' order in block `block`: rotated every block, so no server
    always runs first after the others' pause, or last."""
    k = block % len(SERVERS)
    return SERVERS[k:] + SERVERS[:k]


def cpu_seconds(stats: Iterable[str], groups: set[int], pids: set[int]) -> float:
    """User + system CPU seconds of the processes whose /proc/<pid>/stat
    text is in `stats` and whose process group is in `groups` or pid in `pids`."""
    ticks = 0
    for text in stats:
        pid = int(text.split(" ", 1)[0])
        fields = text.rsplit(")", 1)[1].split()  # from the state on: the command may hold spaces
        if int(fields[2]) in groups or pid in pids:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def descendants(stats: Iterable[str], roots: set[int]) -> set[int]:
    """`roots` and every process below them, whatever their process group
    (`cpcache launch` starts each daemon in a group of its own)."""
    children: dict[int, list[int]] = {}
    for text in stats:
        fields = text.rsplit(")", 1)[1].split()  # from the state on: state, ppid, ...
        children.setdefault(int(fields[1]), []).append(int(text.split(" ", 1)[0]))
    found, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += children.get(pid, [])
    return found


def proc_stats() -> list[str]:
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as fh:
                    out.append(fh.read())
            except OSError:
                pass  # gone meanwhile
    return out


def target_rows(ratios: dict[str, dict]) -> dict[str, dict]:
    return {name: {"median": ratios[name]["median"], "target": f"<= {limit:g}",
                   "met": ratios[name]["median"] <= limit} for name, limit in TARGETS.items()}


# -- the servers ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptWaves:
    requests: int
    waves: int
    new_tokens: int

    def prompts(self, block: int) -> list[list[list[int]]]:
        """Per wave, the requests' prompts: block `block`'s shared prefix and a suffix each."""
        rng = random.Random(block)
        prefix = [rng.randrange(1, VOCAB) for _ in range(PREFIX)]
        return [[prefix + [rng.randrange(1, VOCAB) for _ in range(SUFFIX)] for _ in range(self.requests)]
                for _ in range(self.waves)]


def stream_generate(port: int, input_ids: list[int], new_tokens: int, timeout_s: float = 600.0,
                    model: str | None = None) -> Stream:
    """`model`: the model the request names (a gateway routes by it)."""
    body: dict = {"input_ids": input_ids, "stream": True,
                  "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}
    if model is not None:
        body["model"] = model
    request = urllib.request.Request(f"http://127.0.0.1:{port}/generate", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    stream = Stream(sent=time.perf_counter())
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        for chunk in sse_events(reply):
            stream.add(time.perf_counter(), chunk)
    return stream


def run_wave(port: int, prompts: list[list[int]], new_tokens: int) -> list[Stream]:
    """The prompts sent at once, one thread each: -> their streams, in order."""
    results: list[Stream | BaseException | None] = [None] * len(prompts)

    def one(i: int) -> None:
        try:
            results[i] = stream_generate(port, prompts[i], new_tokens)
        except BaseException as exc:  # noqa: BLE001  (re-raised below, on the caller's thread)
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return [r for r in results if isinstance(r, Stream)]


def measure(streams: list[Stream], seconds: float) -> dict:
    tpots = [t for t in (s.tpot() for s in streams) if t is not None]
    tokens = sum(s.tokens for s in streams)
    return {"tokens": tokens, "seconds": seconds, "tpot_ms": statistics.median(tpots) * 1e3 if tpots else float("nan"),
            "throughput_tok_s": tokens / seconds if seconds > 0 else float("nan"),
            "ttft_ms": statistics.median(s.ttft() for s in streams) * 1e3 if streams else float("nan")}


class Bench:
    def __init__(self, work: Path, workload: PromptWaves) -> None:
        from cpcache.testing.sglang_cpu.hicache import HICACHE_ENV, HICACHE_FLAGS
        from cpcache.testing.sglang_cpu.servers import (
            CPCACHE_HOST_FLAGS,
            Daemons,
            Server,
        )

        self.work = work
        self.workload = workload
        self.model = work / "tiny-llama"
        self.daemons = Daemons(work / "run", tp=TP, settings=dict(host_pool_pages=HOST_PAGES))
        config = work / "sglang-cpcache.json"
        config.write_text(json.dumps({"socket": str(work / "run" / "rank-{rank}.sock"), "model_id": "tiny"}))
        def server(name: str, flags: list[str], env: dict[str, str]) -> Server:
            return Server(name, self.model, work, flags, tp=TP, page_size=PAGE, device_tokens=DEVICE_TOKENS, env=env)

        self.servers = {
            "radix": server("radix", [], {}),
            "hicache": server("hicache", HICACHE_FLAGS, HICACHE_ENV),
            "cpcache": server("cpcache", CPCACHE_HOST_FLAGS, {"CPCACHE_SGLANG_CONFIG": str(config)}),
        }

    def start(self) -> float:
        from cpcache.testing.sglang_cpu.servers import make_tiny_model, start_paused

        started = time.monotonic()
        make_tiny_model(self.model)
        self.daemons.start()
        start_paused(self.servers.values(), timeout_s=900)
        return time.monotonic() - started

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.daemons.stop()

    def backend_now(self) -> dict[int, dict]:
        """Flush the cpcache server's cache and read the line each rank logs."""
        server = self.servers["cpcache"]
        assert server.process is not None
        count = len(server.log_lines(" backend: "))
        server.flush_cache()
        lines = server.process.wait_lines(" backend: ", count + TP, timeout_s=120)
        return backend_lines(lines)

    def block(self, name: str, prompts: list[list[list[int]]]) -> tuple[dict, list[list[int]]]:
        """One server's part of a block: -> its figures and every output."""
        server = self.servers[name]
        assert server.process is not None
        server.process.resume()
        groups = {server.process.proc.pid}
        daemons = {self.daemons.daemon_pid(r) for r in range(TP)} if name == "cpcache" else set()
        try:
            before = self.backend_now() if name == "cpcache" else None
            if name != "cpcache":
                server.flush_cache()
            streams: list[Stream] = []
            cpu_before = proc_stats()
            started = time.perf_counter()
            for wave in prompts:
                streams += run_wave(server.port, wave, self.workload.new_tokens)
            seconds = time.perf_counter() - started
            cpu_after = proc_stats()
            figures = measure(streams, seconds)
            # CPU the server's processes (and cpcache's daemons) spent: work done, less sensitive to the
            # machine's load than wall time.
            server_cpu = cpu_seconds(cpu_after, groups, set()) - cpu_seconds(cpu_before, groups, set())
            daemon_cpu = cpu_seconds(cpu_after, set(), daemons) - cpu_seconds(cpu_before, set(), daemons)
            figures["cpu_ms_per_token"] = (server_cpu + daemon_cpu) / figures["tokens"] * 1e3
            figures["daemon_cpu_ms_per_token"] = daemon_cpu / figures["tokens"] * 1e3
            if before is not None:
                after = self.backend_now()
                figures["backend"] = {rank: backend_delta(before[rank], after[rank]) for rank in sorted(after)}
        finally:
            server.process.pause()
        return figures, [s.output_ids for s in streams]


def summarize(blocks: list[dict[str, dict]], mismatches: int, workload: PromptWaves, start_s: float,
              load: dict, wall_s: float) -> dict:
    servers = {name: {figure: block_summary([b[name][figure] for b in blocks], digits=2)
                      for figure in ("tpot_ms", "throughput_tok_s", "ttft_ms", "cpu_ms_per_token")}
               for name in SERVERS}
    servers["cpcache"]["daemon_cpu_ms_per_token"] = block_summary(
        [b["cpcache"]["daemon_cpu_ms_per_token"] for b in blocks], digits=3)
    ratios = {
        "tpot_cpcache_over_radix": block_ratios(blocks, "tpot_ms", "cpcache", "radix"),
        "tpot_cpcache_over_hicache": block_ratios(blocks, "tpot_ms", "cpcache", "hicache"),
        "tpot_hicache_over_radix": block_ratios(blocks, "tpot_ms", "hicache", "radix"),
        "throughput_cpcache_over_radix": block_ratios(blocks, "throughput_tok_s", "cpcache", "radix"),
        "throughput_cpcache_over_hicache": block_ratios(blocks, "throughput_tok_s", "cpcache", "hicache"),
        "cpu_per_token_cpcache_over_radix": block_ratios(blocks, "cpu_ms_per_token", "cpcache", "radix"),
        "cpu_per_token_cpcache_over_hicache": block_ratios(blocks, "cpu_ms_per_token", "cpcache", "hicache"),
    }
    decode_iterations = workload.waves * (workload.new_tokens - 1)
    backend = {f"rank_{rank}": figures for rank, figures in backend_summary(blocks, decode_iterations).items()}
    return {
        "bench": "sglang", "mode": MODE, "servers_measured": list(SERVERS),
        "setup": {"tp": TP, "model": "tiny random Llama (2 layers, hidden 64, vocab 512), float32, SGLang's CPU path",
                  "page_size": PAGE, "device_tokens": DEVICE_TOKENS, "host_pages": HOST_PAGES,
                  "hicache": "host memory tier, ratio 2, io direct, layer_first",
                  "cpcache": "host tier only (no storage), agreement_lag 0"},
        "workload": {"requests_per_wave": workload.requests, "waves_per_block": workload.waves,
                     "prefix_tokens": PREFIX, "suffix_tokens": SUFFIX, "new_tokens": workload.new_tokens,
                     "blocks": len(blocks)},
        "servers": servers, "ratios": ratios, "targets": target_rows(ratios),
        "backend": backend,
        "backend_note": BACKEND_NOTE.format(decode_iterations=decode_iterations),
        "output_mismatches": mismatches,
        "blocks": blocks, "start_s": round(start_s, 1), "wall_s": round(wall_s, 1), "load_average": load,
    }


def table(report: dict) -> list[str]:
    out = [f"cpcache bench sglang: {report['workload']['blocks']} blocks; {report['mode']}",
           f"{'server':<10} {'TPOT ms':>24} {'tok/s':>24} {'TTFT ms':>24} {'CPU ms/token':>24}"]

    def cell(s: dict) -> str:
        return f"{s['median']:.2f} ({s['spread']['min']:.2f}-{s['spread']['max']:.2f})"

    for name, figures in report["servers"].items():
        out.append(f"{name:<10} {cell(figures['tpot_ms']):>24} {cell(figures['throughput_tok_s']):>24} "
                   f"{cell(figures['ttft_ms']):>24} {cell(figures['cpu_ms_per_token']):>24}")
    out.append("ratio (median over blocks, min-max)")
    for name, r in report["ratios"].items():
        out.append(f"  {name:<34} {r['median']:.3f} ({r['spread']['min']:.3f}-{r['spread']['max']:.3f})")
    for name, t in report["targets"].items():
        out.append(f"  target {name} {t['target']}: {t['median']:.3f} {'met' if t['met'] else 'NOT met'}")
    for rank, b in report["backend"].items():
        out.append(f"backend {rank}: {b['us_per_iteration']['median']:.2f} us per scheduler iteration "
                   f"({b['iterations']['median']:.0f} iterations per block), "
                   f"{b['us_per_decode_iteration']['median']:.1f} us per decode iteration, "
                   f"{b['ms_per_block']['median']:.2f} ms per block ({100 * b['share_of_block']['median']:.3f}% "
                   f"of it), {b['steps']['median']:.0f} steps")
        out.append(f"backend {rank}: idle iterations {b['idle_iterations']['median']:.0f} per block, "
                   f"{b['us_per_idle_iteration']['median']:.2f} us each (p90 over blocks "
                   f"{b['us_per_idle_iteration']['p90']:.2f}); iterations with a step "
                   f"{b['stepping_iterations']['median']:.0f} per block, "
                   f"{b['us_per_stepping_iteration']['median']:.1f} us each "
                   f"(p90 {b['us_per_stepping_iteration']['p90']:.1f})")
    out.append(f"outputs unlike radix's: {report['output_mismatches']}; load average {report['load_average']}")
    return out


def run(workload: PromptWaves, repeat: int, keep: Path | None = None) -> dict:
    work = keep or Path(tempfile.mkdtemp(prefix="cpcache-bench-sglang-"))
    work.mkdir(parents=True, exist_ok=True)
    bench = Bench(work, workload)
    started = time.monotonic()
    load_start = os.getloadavg()
    ok = False
    try:
        start_s = bench.start()
        for name in SERVERS:  # warm-up, not counted
            bench.block(name, workload.prompts(-1))
        blocks: list[dict[str, dict]] = []
        mismatches = 0
        for i in range(repeat):
            prompts = workload.prompts(i)
            block: dict[str, dict] = {}
            outputs: dict[str, list[list[int]]] = {}
            for name in order_of(i):
                block[name], outputs[name] = bench.block(name, prompts)
            mismatches += sum(a != b for name in SERVERS[1:] for a, b in zip(outputs[name], outputs["radix"]))
            blocks.append(block)
        ok = True
    finally:
        bench.stop()
        if ok and keep is None:
            shutil.rmtree(work, ignore_errors=True)
        elif not ok:
            print(f"cpcache bench sglang: logs kept in {work}")
    load = {"start": [round(x, 2) for x in load_start], "end": [round(x, 2) for x in os.getloadavg()]}
    return summarize(blocks, mismatches, workload, start_s, load, time.monotonic() - started)


def main(args: argparse.Namespace) -> int:
    from cpcache.testing.sglang_cpu.servers import SGLANG_PYTHON

    if not SGLANG_PYTHON.exists():
        print(f"cpcache bench sglang: SGLang's environment is not built ({SGLANG_PYTHON} is missing). It runs in a "
              "checkout of cpcache: `make setup` builds .venv-sglang there (or set CPCACHE_SGLANG_PYTHON to an "
              "interpreter with SGLang 0.5.23 and cpcache installed).", file=sys.stderr)
        return 1
    workload = PromptWaves(requests=args.requests, waves=args.waves, new_tokens=args.new_tokens)
    report = run(workload, args.repeat, Path(args.work_dir) if args.work_dir else None)
    if args.json:
        print(json.dumps(report))
    else:
        print("\n".join(table(report)))
    return 0
