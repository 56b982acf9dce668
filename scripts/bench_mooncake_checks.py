"""Mooncake Store reads and writes through the backend (framed, checked)
before and after a change to it, against the calls SGLang's MooncakeStore
makes for the same pages (unchecked: `batch_get_into` / `batch_put_from` of
each page's K and V runs), all three in one process over one master.

"Before" is the backend (`storage/mooncake.py`, `storage/framing.py`) as
git revision `--before` has it, loaded beside this tree's; both register
the same host pool. Each block of a page size puts 64 MiB of fresh pages on
every side in a rotating order and reads them back in a rotating order
(every page stays stored: nothing is evicted, no put refused), then
checksums them on one thread (`xxh3_gib_s`: what a checked read pays on top
of the bytes it moves, where no other core is free); a ratio per block is SGLang's time over the side's
(below 1: slower than SGLang's), reported as the median over the blocks
with its spread (`cpcache.testing.stats.block_summary`).

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_mooncake_checks.py --before main [--blocks 15]

Also the checks alone, on the CPU clock (what load on a shared host
stretches least): a batch of 1,024 framed pages of 256 bytes in two runs
each, checked by each side's framing (`check_pages` before, `check_batch`
after), microseconds per page.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

from cpcache.dataplane.movers import Tiers
from cpcache.dataplane.pools import HostPool
from cpcache.dataplane.storage.framing import digests
from cpcache.dataplane.storage.mooncake import MooncakeBackend
from cpcache.testing.mooncake_master import MooncakeMaster
from cpcache.testing.stats import block_summary
from cpcache.tools.bench.movers import BATCH_BYTES, PAGE_SIZES, geometry_for
from cpcache.tools.bench.storage_baselines import sglang_mooncake_calls

REPO = Path(__file__).resolve().parents[1]
FRAMING = "cpcache/dataplane/storage/framing.py"
MOONCAKE = "cpcache/dataplane/storage/mooncake.py"


def _module(name: str, source: str) -> types.ModuleType:
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return module


def backend_at(revision: str) -> tuple[type[MooncakeBackend], types.ModuleType]:
    """The Mooncake backend class of `revision`, and its own framing."""
    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{revision}:{path}"], cwd=REPO, check=True, capture_output=True,
                              text=True).stdout

    framing = _module("cpcache_before_framing", show(FRAMING))
    source = show(MOONCAKE).replace("from cpcache.dataplane.storage.framing import",
                                    "from cpcache_before_framing import")
    source = source.replace('@register("mooncake")\n', "")  # this tree's class stays the registered one
    backend: type[MooncakeBackend] = _module("cpcache_before_mooncake", source).MooncakeBackend
    return backend, framing


def checks_cpu_us(before: types.ModuleType, blocks: int, pages: int = 1024, nbytes: int = 256) -> dict:
    """CPU microseconds per page of a batch's checks, each side's framing."""
    from cpcache.dataplane.storage import framing

    memory = bytearray(os.urandom(pages * nbytes))
    view = memoryview(memory)
    runs = [[view[i * nbytes : i * nbytes + nbytes // 2], view[i * nbytes + nbytes // 2 : (i + 1) * nbytes]]
            for i in range(pages)]
    headers = b"".join(framing.pack_header(7, run) for run in runs)
    lengths, whole = [nbytes] * pages, [True] * pages
    np_lengths, np_whole = np.asarray(lengths, dtype=np.uint64), np.asarray(whole, dtype=bool)
    sides = {"before": lambda: before.check_pages(headers, runs, lengths, whole, 7),
             "after": lambda: framing.check_batch(headers, runs, np_lengths, np_whole, 7)}
    cpu: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(blocks):
        for name, check in sides.items():
            start = time.process_time()
            check()
            cpu[name].append(time.process_time() - start)
    return {name: round(statistics.median(t) / pages * 1e6, 3) for name, t in cpu.items()}


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def all_true(done: list[bool], what: str) -> None:
    if not all(done):
        raise RuntimeError(f"bench: {what} moved {sum(done)} of {len(done)} pages")


def page_size_rows(master: MooncakeMaster, before: type[MooncakeBackend], page_bytes: int, tokens: int,
                   blocks: int) -> list[dict]:
    geometry = geometry_for(tokens)
    n = BATCH_BYTES // page_bytes
    host = HostPool(geometry, pages=n, layout="page_first_direct")
    pages = Tiers(host).host_buffers(list(range(n)))
    options = dict(master=master.master, metadata_server=master.metadata_server, buffers=[(host.address, host.nbytes)],
                   # either segment holds every block's pages of the three sides: the
                   # store stays below its eviction watermark
                   global_segment_size=(3 * blocks + 4) * BATCH_BYTES, local_buffer_size=16 << 20,
                   geometry_fingerprint=geometry.fingerprint())
    sides = {"before": before(**options), "after": MooncakeBackend(**options)}  # type: ignore[arg-type]
    raw = sides["after"]._store

    def fresh() -> list[str]:
        prefix = uuid.uuid4().hex[:12]
        return [f"m{prefix}_{i}" for i in range(n)]

    sglang_put, sglang_get = sglang_mooncake_calls(raw, pages, fresh)
    keys: dict[str, list[str]] = {}

    def put(name: str) -> Callable[[], None]:
        def run() -> None:
            keys[name] = fresh()
            all_true(sides[name].put_from(keys[name], pages), f"a put ({name})")
        return run

    def get(name: str) -> Callable[[], None]:
        return lambda: all_true(sides[name].get_into(keys[name], pages), f"a get ({name})")

    runs = [page.views for page in pages]
    everything = list(range(n))
    work: dict[str, dict[str, Callable[[], object]]] = {
        "put": {"sglang": sglang_put, "before": put("before"), "after": put("after")},
        "get": {"sglang": sglang_get, "before": get("before"), "after": get("after")},
        "hash": {"xxh3": lambda: digests(runs, everything)},  # the checksums alone, on one thread
    }
    times: dict[str, dict[str, list[float]]] = {op: {side: [] for side in calls} for op, calls in work.items()}
    try:
        for block in range(blocks):
            for op, calls in work.items():
                names = list(calls)
                shift = block % len(names)
                for name in names[shift:] + names[:shift]:
                    times[op][name].append(timed(calls[name]))
    finally:
        for backend in sides.values():
            backend.close()
    hashed = times.pop("hash")["xxh3"]
    rows = []
    for op, sides_times in times.items():
        theirs = sides_times["sglang"]
        row: dict = {"op": op, "page_bytes": page_bytes,
                     "sglang_gib_s": round(BATCH_BYTES / statistics.median(theirs) / (1 << 30), 3)}
        for name in ("before", "after"):
            ours = sides_times[name]
            row[name] = {"gib_s": round(BATCH_BYTES / statistics.median(ours) / (1 << 30), 3),
                         "vs_sglang": block_summary([t / o for t, o in zip(theirs, ours)])}
        row["after_vs_before"] = block_summary([b / a for b, a in zip(sides_times["before"], sides_times["after"])])
        row["xxh3_gib_s"] = round(BATCH_BYTES / statistics.median(hashed) / (1 << 30), 3)
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="main", help="the git revision whose backend is 'before'")
    parser.add_argument("--blocks", type=int, default=15)
    args = parser.parse_args()
    before, before_framing = backend_at(args.before)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="cpc-mc-checks-") as tmp, MooncakeMaster(Path(tmp) / "master.log") as m:
        for page_bytes, tokens in PAGE_SIZES.items():
            rows += page_size_rows(m, before, page_bytes, tokens, args.blocks)
    print(json.dumps({"before": args.before, "blocks": args.blocks, "batch_bytes": BATCH_BYTES, "rows": rows,
                      "checks_cpu_us_per_page": checks_cpu_us(before_framing, args.blocks)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
