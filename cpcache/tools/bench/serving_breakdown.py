"""Where a request's cost goes in `cpcache bench serving`, per request sent
between two flushes (the trace's, bench_serving's warmup one, the check
set): the CPU of each kind of process (the server's schedulers, the
rest of the server: its HTTP, tokenizer and detokenizer processes;
cpcache's daemons; a Mooncake master) and, on a cpcache server, the
backend's own time on each scheduler thread by call (SGLang's calls into
the cache: match, insert, load_back, prefetch, progress; the per-iteration
hook, its steps included) and the forward's waits for the layers of its
load-backs (`integrations/sglang/timing.py`, logged at each flush_cache).

HiCache's cache path runs inside SGLang's schedulers, so at equal hits the
schedulers' CPU per request of the two stacks, with cpcache's daemons
beside it, is the comparison; the backend's figures say where cpcache's
part of a scheduler's time goes."""

from __future__ import annotations

import re
from collections.abc import Iterable

from cpcache.tools.bench.sglang import cpu_seconds, descendants, proc_stats

ROLES = ("schedulers", "server_rest", "daemons", "master")
SCHEDULER_TITLE = b"sglang::scheduler"  # SGLang's process title of a scheduler (setproctitle)
CALL = re.compile(r"(?P<kind>\w+) (?P<seconds>[\d.]+) s x (?P<calls>\d+)")
LOAD_WAITS = re.compile(r"loads waited (?P<seconds>[\d.]+) s in (?P<waits>\d+) layer waits")
REPLY_WAITS = re.compile(r"s in steps \((?P<seconds>[\d.]+) s waiting for replies\)")


def is_scheduler(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().startswith(SCHEDULER_TITLE)
    except OSError:
        return False


def role_cpu(server: int | None, daemons: int | None, master: int | None) -> dict[str, float]:
    """CPU seconds so far of each role, from the processes' pids (None: no
    such process): the server's and the daemon launcher's trees."""
    stats = proc_stats()
    served = descendants(stats, {server}) if server is not None else set()
    schedulers = {pid for pid in served if is_scheduler(pid)}
    return {"schedulers": cpu_seconds(stats, set(), schedulers),
            "server_rest": cpu_seconds(stats, set(), served - schedulers),
            "daemons": cpu_seconds(stats, set(), descendants(stats, {daemons})) if daemons is not None else 0.0,
            "master": cpu_seconds(stats, set(), {master}) if master is not None else 0.0}


def call_times(line: str) -> dict:
    """A backend line's per-call figures: kind -> [seconds, calls], and the
    forward's load waits (absent from a backend that logs none)."""
    calls_part = line.partition("; calls ")[2].partition("; loads waited")[0]
    kinds = {m["kind"]: [float(m["seconds"]), int(m["calls"])] for m in CALL.finditer(calls_part)}
    waits, replies = LOAD_WAITS.search(line), REPLY_WAITS.search(line)
    return {"kinds": kinds, "load_wait_s": float(waits["seconds"]) if waits else 0.0,
            "load_waits": int(waits["waits"]) if waits else 0,
            "reply_wait_s": float(replies["seconds"]) if replies else 0.0}


def backend_by_rank(lines: Iterable[str]) -> dict[int, dict]:
    """The last backend line of every rank: rank -> its hook's seconds and call_times."""
    out: dict[int, dict] = {}
    for line in lines:
        found = re.search(r"cpcache: rank (\d+) backend: .*?\(hook ([\d.]+) s", line)
        if found:
            out[int(found[1])] = {"hook_s": float(found[2]), **call_times(line)}
    return out


def per_request(cpu_before: dict[str, float], cpu_after: dict[str, float], requests: int,
                backend_before: dict[int, dict] | None = None, backend_after: dict[int, dict] | None = None) -> dict:
    """Milliseconds per request over one window, the `requests` sent in it:
    each role's CPU, and (a cpcache server) rank 0's backend time by call
    between its two lines."""
    n = max(requests, 1)
    out: dict = {"cpu_ms": {role: round((cpu_after[role] - cpu_before[role]) / n * 1e3, 2) for role in ROLES}}
    if backend_before is not None and backend_after is not None and 0 in backend_after:
        before = backend_before.get(0, {"hook_s": 0.0, "kinds": {}, "load_wait_s": 0.0, "reply_wait_s": 0.0})
        after = backend_after[0]
        spent = {"hook": after["hook_s"] - before["hook_s"],
                 # of the hook's and the calls' steps, waiting for their replies
                 "reply_waits": after.get("reply_wait_s", 0.0) - before.get("reply_wait_s", 0.0),
                 **{kind: seconds - before["kinds"].get(kind, [0.0, 0])[0]
                    for kind, (seconds, _calls) in after["kinds"].items()},
                 "load_waits": after["load_wait_s"] - before["load_wait_s"]}
        out["rank0_backend_ms"] = {kind: round(seconds / n * 1e3, 3) for kind, seconds in spent.items()}
    return out


def table(report: dict) -> list[str]:
    """The per-request breakdown, one row per server (ms per request)."""
    kinds = ("hook", "reply_waits", "match", "insert", "load_back", "prefetch", "progress", "load_waits")
    lines = ["| server | schedulers CPU | rest of server CPU | daemons CPU | master CPU | "
             + " | ".join(f"rank 0 {k}" for k in kinds) + " |", "|---|" + "---:|" * (4 + len(kinds))]
    for name, row in report["servers"].items():
        found = row.get("per_request")
        if not found:
            continue
        cpu, backend = found["cpu_ms"], found.get("rank0_backend_ms") or {}
        lines.append(f"| {name} | " + " | ".join(f"{cpu[r]:.2f}" for r in ROLES) + " | "
                     + " | ".join(f"{backend[k]:.3f}" if k in backend else "-" for k in kinds) + " |")
    return lines
