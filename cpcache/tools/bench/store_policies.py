"""`cpcache bench store-policies`: what a bounded store can give on `bench
serving`'s trace, under which policy.

The same prompts `bench serving` sends (its scaled trace, built as SGLang's
Mooncake dataset builds them, tokenized as its word-level tokenizer does)
go page by page through the memory tiers, one least-recently-used cache of
the device's and the host's pages, and a store of `capacity` pages beneath.
A request hits the run of its first pages found in memory, then the run
after it found in the store; it then writes its pages the store lacks, as
far as the policy admits them. Counted: hit pages per tier, for each
policy and capacity, against the plain LRU at a CP rank's share of the
bytes (HiCache keeps a copy per CP rank, cpcache one per page).

No server and no clock: SGLang's queue and admission order are left out, so
the figures land within about a point of the measured ones (docs/benchmarks.md,
"Hit rates, and what a bounded store can give", has both). Seconds, not
minutes: a capacity policy is judged here before a serving run.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import re
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from cpcache.tools.bench.serving import (
    BOUND_PAGES,
    CP,
    DEVICE_TOKENS,
    HOST_PAGES,
    PAGE,
    REQUESTS,
    TRACE,
    scaled_trace,
)

MEMORY_PAGES = DEVICE_TOKENS // PAGE + HOST_PAGES
# Admit: (request's page keys, page's depth) -> whether the store takes the page.
Admit = Callable[[list[bytes], int], bool]


def prompt_tokens(hash_ids: list[int]) -> list[str]:
    """The prompt SGLang's Mooncake dataset makes of a row (first round, no
    chat template: "user: ..."), split as the bench's tokenizer splits it
    (on whitespace, digits one by one, punctuation apart)."""
    base = "".join(f"{h}" + " ".join(["hi"] * 128) for h in hash_ids) + "Tell me a story based on this context."
    text = f"user: Round 1: {base}"
    return [piece for word in text.split() for piece in re.findall(r"\d|[^\d\w\s]|[^\d\W]+", word)]


def request_pages(trace: Path) -> list[list[bytes]]:
    """Each request's full pages, as keys naming their whole prefix."""
    requests = []
    for line in trace.read_text().splitlines():
        tokens = prompt_tokens(json.loads(line)["hash_ids"])
        keys, prefix = [], hashlib.blake2b(digest_size=16)
        for i in range(len(tokens) // PAGE):
            prefix.update(" ".join(tokens[i * PAGE : (i + 1) * PAGE]).encode() + b"\n")
            keys.append(prefix.copy().digest())
        requests.append(keys)
    return requests


def _by_hash(key: bytes, fraction: float) -> bool:
    return int.from_bytes(key[:4], "little") < fraction * (1 << 32)


POLICIES: dict[str, Admit] = {
    "lru": lambda keys, depth: True,
    # A request's pages admitted whole or not at all, by a hash of its last page: chains stay unbroken.
    "lru, 70 % of requests": lambda keys, depth: _by_hash(keys[-1], 0.7),
    "lru, 90 % of requests": lambda keys, depth: _by_hash(keys[-1], 0.9),
    # Every request's first pages only: chains cut short, more of them kept.
    "lru, pages before the 35th": lambda keys, depth: depth < 35,
    "lru, pages before the 40th": lambda keys, depth: depth < 40,
}


def replay(requests: list[list[bytes]], capacity: int, admit: Admit | None,
           memory_pages: int = MEMORY_PAGES, threshold_tokens: int = 0) -> dict[str, int]:
    """Hit pages per tier over the trace; `capacity` 0: unbounded; `admit`
    None: the offline optimum (every page written, the one used again last
    evicted: the bound no policy passes); `threshold_tokens`: a storage run
    shorter than this is not read (`prefetch_threshold_tokens`), its pages
    computed."""
    uses: dict[bytes, collections.deque[int]] = collections.defaultdict(collections.deque)
    for r, keys in enumerate(requests):
        for key in keys:
            uses[key].append(r)
    memory: OrderedDict[bytes, None] = OrderedDict()
    store: OrderedDict[bytes, None] = OrderedDict()
    hits = {"pages": 0, "memory": 0, "storage": 0, "below_threshold": 0}
    for keys in requests:
        for key in keys:
            uses[key].popleft()
        hits["pages"] += len(keys)
        in_memory = 0
        while in_memory < len(keys) and keys[in_memory] in memory:
            in_memory += 1
        in_store = in_memory
        while in_store < len(keys) and keys[in_store] in store:
            in_store += 1
        if (in_store - in_memory) * PAGE < threshold_tokens:
            hits["below_threshold"] += in_store - in_memory
            in_store = in_memory
        for key in keys[in_memory:in_store]:
            store.move_to_end(key)
        hits["memory"] += in_memory
        hits["storage"] += in_store - in_memory
        for key in keys:
            memory[key] = None
            memory.move_to_end(key)
        while len(memory) > memory_pages:
            memory.popitem(last=False)
        for depth, key in enumerate(keys):
            if key not in store and (admit is None or admit(keys, depth)):
                store[key] = None
        if capacity and len(store) > capacity:
            if admit is None:
                for key in sorted(store, key=lambda k: uses[k][0] if uses[k] else len(requests))[capacity:]:
                    del store[key]
            while len(store) > capacity:
                store.popitem(last=False)
    return hits


def run(requests: int = REQUESTS) -> dict:
    with tempfile.TemporaryDirectory() as work:
        pages = request_pages(scaled_trace(TRACE, Path(work) / "trace.jsonl", requests=requests))
    rows: list[dict] = []
    capacities = {"unbounded": 0, "the bound": BOUND_PAGES, "a CP rank's share of it": BOUND_PAGES // CP}
    for store, capacity in capacities.items():
        for name, admit in [*POLICIES.items(), ("offline optimum", None)]:
            if capacity == 0 and name != "lru":
                continue
            hits = replay(pages, capacity, admit)
            rows.append({"policy": name, "store": store, "capacity_pages": capacity,
                         "hit_rate": (hits["memory"] + hits["storage"]) / hits["pages"],
                         "storage_tokens": hits["storage"] * PAGE})
    baseline = next(r for r in rows if r["policy"] == "lru" and r["store"] == "a CP rank's share of it")
    for row in rows:
        row["hit_rate_vs_lru_at_a_share"] = row["hit_rate"] / baseline["hit_rate"]
    return {"requests": requests, "memory_pages": MEMORY_PAGES, "rows": rows, "capacity": capacity_rows(pages),
            "thresholds": threshold_rows(pages)}


CP_SIZES = (2, 4, 8)
CAPACITY_BOUNDS = (BOUND_PAGES, 2 * BOUND_PAGES, 4 * BOUND_PAGES)
THRESHOLDS = (0, 16, 32, 64, 128, 256)  # prefetch_threshold_tokens swept; 256 the old default


def capacity_rows(pages: list[list[bytes]]) -> list[dict]:
    """Equal storage bytes (`bound` pages of one CP rank's KV: serving's bound,
    twice and four times it) at CP 2, 4 and 8: HiCache's file backend writes
    each CP-replicated page once per CP rank, so it holds `bound / CP` pages;
    cpcache writes it once per domain, `bound`."""
    rows = []
    for bound, cp in ((b, cp) for b in CAPACITY_BOUNDS for cp in CP_SIZES):
        held = {"cpcache": bound, "hicache": bound // cp}
        rates = {}
        for stack, capacity in held.items():
            hits = replay(pages, capacity, POLICIES["lru"])
            rates[stack] = (hits["memory"] + hits["storage"]) / hits["pages"]
            rates[f"{stack}_storage_tokens"] = hits["storage"] * PAGE
        rows.append({"cp": cp, "storage_bytes_pages": bound, "cpcache_pages": held["cpcache"],
                     "hicache_pages": held["hicache"], **rates, "ratio": rates["cpcache"] / rates["hicache"]})
    return rows


def threshold_rows(pages: list[list[bytes]]) -> list[dict]:
    """The storage hits each `prefetch_threshold_tokens` gives up, unbounded and at the bound."""
    rows = []
    for store, capacity in (("unbounded", 0), ("the bound", BOUND_PAGES)):
        for threshold in THRESHOLDS:
            hits = replay(pages, capacity, POLICIES["lru"], threshold_tokens=threshold)
            rows.append({"store": store, "threshold_tokens": threshold,
                         "hit_rate": (hits["memory"] + hits["storage"]) / hits["pages"],
                         "storage_tokens": hits["storage"] * PAGE,
                         "storage_tokens_below_threshold": hits["below_threshold"] * PAGE})
    return rows


def text_report(report: dict) -> str:
    lines = [f"{report['requests']} requests, memory tiers {report['memory_pages']} pages (LRU)",
             "| store | policy | hit % | storage tokens | hit rate vs LRU at a CP rank's share |",
             "|---|---|---:|---:|---:|"]
    lines += [f"| {r['store']} ({r['capacity_pages'] or '-'} pages) | {r['policy']} | {100 * r['hit_rate']:.2f} | "
              f"{r['storage_tokens']:,} | {r['hit_rate_vs_lru_at_a_share']:.2f} |" for r in report["rows"]]
    lines += ["", "Equal storage bytes (LRU):", "| CP | pages held, cpcache / HiCache | cpcache hit % | HiCache hit % "
              "| ratio |", "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['cp']} | {r['cpcache_pages']} / {r['hicache_pages']} | {100 * r['cpcache']:.2f} | "
              f"{100 * r['hicache']:.2f} | {r['ratio']:.2f} |" for r in report["capacity"]]
    lines += ["", "prefetch_threshold_tokens (LRU):", "| store | threshold | hit % | storage tokens | "
              "given up |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['store']} | {r['threshold_tokens']} | {100 * r['hit_rate']:.2f} | {r['storage_tokens']:,} | "
              f"{r['storage_tokens_below_threshold']:,} |" for r in report["thresholds"]]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    report = run(getattr(args, "trace_requests", None) or REQUESTS)
    print(json.dumps(report, indent=2) if args.json else text_report(report))
    return 0
