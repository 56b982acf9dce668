"""`cpcache bench movers`: each mover's throughput against the raw operation
it is built on, measured alternately in the same run:

- device <-> host on CUDA: `cudaMemcpyAsync` of pinned memory (one torch
  `copy_(non_blocking=True)` of the same bytes between a pinned host buffer
  and device memory, then a stream sync), the most the bus gives;
- device <-> host without CUDA: torch `index_select(out=)` over the same pages;
- host <-> file: a plain write / read loop over the same pages (`raw`), and
  the same integrity work by hand (`framed`: `storage_baselines.py`);
- host <-> mooncake: `batch_put_from` / `batch_get_into` on the same buffers
  (`raw`), the framed pages by hand (`framed`), and the calls SGLang's
  MooncakeStore makes for them (`sglang`).

`--against sglang` adds SGLang's own `HiCacheFile` on the same pages, beside
the file movers, in SGLang's environment (`movers_sglang.py`).

On a host without CUDA the device pool is a shared-memory file (as attached
by an inference process there), so device <-> host is a memory copy.
`--device-only`: device <-> host alone, for every host layout (the GPU check);
`--mooncake-only`: host <-> Mooncake Store alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from cpcache.dataplane.movers import DEVICE, HOST, STORAGE, Tiers, TransferResult, Transfers
from cpcache.dataplane.pools import DevicePool, HostPool
from cpcache.dataplane.storage import open_backend
from cpcache.geometry import KVGeometry
from cpcache.host_layout import LAYOUTS
from cpcache.testing.mooncake_master import MooncakeMaster
from cpcache.testing.stats import block_summary
from cpcache.tools.bench import storage_baselines

PAGE_SIZES = {64 << 10: 4, 1 << 20: 64, 4 << 20: 256}  # page bytes -> tokens per page
BATCH_BYTES = 64 << 20
REPEATS = 5


def geometry_for(tokens_per_page: int) -> KVGeometry:
    # 16 KiB per token: 4 layers x K,V x 8 heads x 128 x bf16
    return KVGeometry(layers=4, kv_kind="mha", heads=8, head_dim=128, dtype="bfloat16", page_size=tokens_per_page)


def gib_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / (1 << 30)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def compare_in_blocks(mover: Callable[[], object], raw: Callable[[], object], nbytes: int, blocks: int) -> dict:
    """Alternate the two in blocks (raw, then mover) so drift on a shared
    machine hits both alike; `ratio` is the median over the blocks of each
    block's mover rate over its raw rate (`spread`: min-max and IQR)."""
    ours, base = [], []
    for _ in range(blocks):
        base.append(timed(raw))
        ours.append(timed(mover))
    mover_rate = gib_s(nbytes, statistics.median(ours))
    raw_rate = gib_s(nbytes, statistics.median(base))
    summary = block_summary([b / o for o, b in zip(ours, base)])
    return {"gib_s": round(mover_rate, 3), "raw_gib_s": round(raw_rate, 3), "ratio": summary["median"],
            "median": summary["median"], "spread": summary["spread"]}


def compare_many(mover: Callable[[], object], baselines: dict[str, Callable[[], object]], nbytes: int,
                 blocks: int) -> dict:
    """`compare_in_blocks` against several baselines: each block runs every
    baseline and the mover, in an order rotating from block to block (a
    write run after others meets the disk's writeback of theirs); `against[name]`
    is the median over the blocks of the mover's rate over that baseline's."""
    sides: dict[str, Callable[[], object]] = {**baselines, "": mover}
    names = list(sides)
    times: dict[str, list[float]] = {name: [] for name in names}
    for block in range(blocks):
        shift = block % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(timed(sides[name]))
    ours = times.pop("")
    against = {}
    for name, theirs in times.items():
        summary = block_summary([b / o for o, b in zip(ours, theirs)])
        against[name] = {"gib_s": round(gib_s(nbytes, statistics.median(theirs)), 3), "ratio": summary["median"],
                         "spread": summary["spread"]}
    return {"gib_s": round(gib_s(nbytes, statistics.median(ours)), 3), "against": against}


def device_pool(geometry: KVGeometry, pages: int) -> DevicePool:
    """Random pages where an inference process keeps its pool: device memory
    on CUDA, a shared-memory file elsewhere."""
    if torch.cuda.is_available():
        pool = DevicePool.of_tensor(geometry, torch.empty(geometry.pool_shape(pages), dtype=geometry.torch_dtype,
                                                          device="cuda"))
        pool.tensor.view(-1).view(torch.uint8).random_(0, 256)
        return pool
    pool = DevicePool.create_sealed(geometry, pages=pages)
    pool.tensor.view(-1).view(torch.uint8).copy_(torch.randint(0, 256, (pool.tensor.numel() * 2,), dtype=torch.uint8))
    return pool


def raw_device_copies(device: DevicePool, pages: int) -> tuple[Callable[[], object], Callable[[], object], str]:
    """(device->host, host->device, what they are): the raw copies of the
    same bytes a mover of `pages` pages moves."""
    g = device.geometry
    if device.tensor.is_cuda:
        nbytes = pages * g.page_bytes
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        memory = device.tensor.view(-1).view(torch.uint8)[:nbytes]
        stream = torch.cuda.current_stream(device.tensor.device)

        def d2h() -> None:
            pinned.copy_(memory, non_blocking=True)
            stream.synchronize()

        def h2d() -> None:
            memory.copy_(pinned, non_blocking=True)
            stream.synchronize()

        return d2h, h2d, "cudaMemcpyAsync of pinned memory (torch copy_ non_blocking, stream sync)"
    tokens_idx = torch.arange(pages * g.page_size)
    gathered = torch.empty((g.layers, g.components, pages * g.page_size, g.heads, g.head_dim), dtype=g.torch_dtype)
    return (lambda: torch.index_select(device.tensor, 2, tokens_idx, out=gathered),
            lambda: torch.index_select(gathered, 2, tokens_idx, out=device.tensor), "torch index_select(out=)")


def device_host_entries(device: DevicePool, host: HostPool, blocks: int) -> list[dict]:
    """device->host and host->device of every page, against the raw copies."""
    pages = list(range(min(device.pages, host.pages)))
    nbytes = len(pages) * device.geometry.page_bytes
    raw_d2h, raw_h2d, baseline = raw_device_copies(device, len(pages))
    transfers = Transfers(Tiers(host, device), threads=1)
    try:
        out = []
        for name, mover, raw in (("device->host", (DEVICE, HOST), raw_d2h), ("host->device", (HOST, DEVICE), raw_h2d)):
            figures = compare_in_blocks(partial(move_all, transfers, mover, pages), raw, nbytes, blocks)
            out.append({"mover": name, "page_bytes": device.geometry.page_bytes, "host_layout": host.layout,
                        "baseline": baseline, **figures})
        return out
    finally:
        transfers.close()


def move_all(transfers: Transfers, route: tuple[str, str], pages: list[int]) -> None:
    moved(transfers.submit(route, pages, pages).result(), len(pages))


def moved(result: TransferResult, pages: int) -> None:
    """A timing is only of a transfer that moved every page: one that failed
    fast would read as a fast mover."""
    if not result.success or result.pages_done != pages:
        raise RuntimeError(f"bench movers: a transfer moved {result.pages_done} of {pages} pages")


def all_ok(codes: list[int], expected: int, what: str) -> None:
    """The same for a raw Mooncake batch call (`expected`: each key's code)."""
    bad = sum(1 for c in codes if c != expected)
    if bad:
        raise RuntimeError(f"bench movers: raw mooncake {what} failed for {bad} of {len(codes)} pages")


def bench_device_host(page_bytes: int, tokens: int, blocks: int = REPEATS) -> list[dict]:
    """device <-> host for every host layout."""
    geometry = geometry_for(tokens)
    n = max(8, BATCH_BYTES // page_bytes)
    device = device_pool(geometry, n)
    out: list[dict] = []
    for layout in LAYOUTS:
        out += device_host_entries(device, HostPool(geometry, pages=n, layout=layout), blocks)
    return out


def bench_page_size(page_bytes: int, tokens: int, work: Path, master: MooncakeMaster | None,
                    blocks: int = REPEATS, mooncake_only: bool = False) -> list[dict]:
    geometry = geometry_for(tokens)
    assert geometry.page_bytes == page_bytes
    n = max(8, BATCH_BYTES // page_bytes)
    nbytes = n * page_bytes
    device = device_pool(geometry, n)
    host = HostPool(geometry, pages=n, layout="page_first_direct")
    pages = list(range(n))
    out = [] if mooncake_only else device_host_entries(device, host, blocks)

    def entry(name: str, figures: dict) -> None:
        out.append({"mover": name, "page_bytes": page_bytes, **figures})

    def compare(mover: Callable[[], object], baselines: dict[str, Callable[[], object]]) -> dict:
        return compare_many(mover, baselines, nbytes, blocks)

    # Every repeat writes new pages (new files, new keys) on every side, as a cache does.
    storage = open_backend("file", root=str(work / f"files-{page_bytes}"), geometry_fingerprint=geometry.fingerprint())
    transfers = Transfers(Tiers(host, device, storage), threads=1)
    buffers = Tiers(host).host_buffers(pages)
    raw_dir = work / f"raw-{page_bytes}"
    raw_dir.mkdir()
    written: dict[str, list] = {"mover": [], "raw": []}

    def fresh(side: str = "") -> list[str]:
        names = [f"f{uuid.uuid4().hex[:12]}_{i}" for i in pages]
        if side:
            written[side].append(names)
        return names

    def raw_write() -> None:
        for name, buf in zip(fresh("raw"), buffers):
            with open(raw_dir / name, "wb") as fh:
                fh.writelines(buf.views)

    def raw_read() -> None:
        for name, buf in zip(written["raw"][-1], buffers):
            with open(raw_dir / name, "rb") as fh:
                for view in buf.views:
                    fh.readinto(view)

    framed_put, framed_get = storage_baselines.framed_file(work / f"framed-{page_bytes}", geometry.fingerprint(),
                                                           buffers, fresh)
    if not mooncake_only:
        entry("host->file", compare(
            lambda: moved(transfers.submit((HOST, STORAGE), pages, fresh("mover")).result(), n),
            {"raw": raw_write, "framed": framed_put}))
        entry("file->host", compare(
            lambda: moved(transfers.submit((STORAGE, HOST), written["mover"][-1], pages).result(), n),
            {"raw": raw_read, "framed": framed_get}))
    transfers.close()

    if master is not None:
        from cpcache.dataplane.storage.mooncake import MooncakeBackend

        store = open_backend("mooncake", master=master.master, metadata_server=master.metadata_server,
                             buffers=[(host.address, host.nbytes)],
                             # every put of this page size stays stored (nothing evicted, no put refused)
                             global_segment_size=(4 * blocks + 4) * BATCH_BYTES + (64 << 20),
                             local_buffer_size=16 << 20)
        assert isinstance(store, MooncakeBackend)
        raw_store = store._store  # the mooncake store itself, for the raw calls
        transfers = Transfers(Tiers(host, device, store), threads=1)
        runs = [part for b in buffers for part in b.parts]

        def fresh_keys() -> list[str]:
            prefix = uuid.uuid4().hex[:12]
            return [f"m{prefix}_{i}" for i in pages]

        bare: list[list[str]] = []

        def raw_put() -> None:
            keys = [f"{k}_{r}" for k in fresh_keys() for r in range(len(buffers[0].parts))]
            all_ok(raw_store.batch_put_from(keys, [a for a, _ in runs], [v.nbytes for _, v in runs]), 0, "put")
            bare.append(keys)

        def raw_get() -> None:
            codes = raw_store.batch_get_into(bare[-1], [a for a, _ in runs], [v.nbytes for _, v in runs])
            if any(c != v.nbytes for c, (_, v) in zip(codes, runs)):
                raise RuntimeError("bench movers: a raw mooncake get failed")

        framed_put, framed_get = storage_baselines.framed_mooncake(raw_store, geometry.fingerprint(), buffers,
                                                                   fresh_keys)
        sglang_put, sglang_get = storage_baselines.sglang_mooncake_calls(raw_store, buffers, fresh_keys)
        mover_keys: list[list[str]] = []

        def put_via_mover() -> None:
            mover_keys.append(fresh_keys())
            moved(transfers.submit((HOST, STORAGE), pages, mover_keys[-1]).result(), n)

        entry("host->mooncake", compare(put_via_mover, {"raw": raw_put, "framed": framed_put, "sglang": sglang_put}))
        # Each side reads what it wrote last: the mover's and the framed objects
        # are framed pages (header and checksum), the raw and SGLang's bare runs.
        entry("mooncake->host", compare(
            lambda: moved(transfers.submit((STORAGE, HOST), mover_keys[-1], pages).result(), n),
            {"raw": raw_get, "framed": framed_get, "sglang": sglang_get}))
        raw_store.remove_all()
        transfers.close()
    return out


def run(with_mooncake: bool = True, blocks: int = REPEATS, device_only: bool = False,
        mooncake_only: bool = False) -> dict:
    movers: list[dict] = []
    if device_only:
        for page_bytes, tokens in PAGE_SIZES.items():
            movers += bench_device_host(page_bytes, tokens, blocks)
        return {"movers": movers, "batch_bytes": BATCH_BYTES, "repeats": blocks, "host_layouts": list(LAYOUTS),
                "device": device_name()}
    with tempfile.TemporaryDirectory(prefix="cpc-movers-") as tmp:
        work = Path(tmp)
        master = MooncakeMaster(work / "master.log").__enter__() if with_mooncake else None
        try:
            for page_bytes, tokens in PAGE_SIZES.items():
                movers += bench_page_size(page_bytes, tokens, work, master, blocks, mooncake_only)
        finally:
            if master is not None:
                master.stop()
    return {"movers": movers, "batch_bytes": BATCH_BYTES, "repeats": blocks, "host_layout": "page_first_direct",
            "device": device_name()}


def device_name() -> str:
    return f"cuda ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "shared-memory file (no CUDA)"


def against_sglang(blocks: int) -> list[dict]:
    """The file movers and SGLang's HiCacheFile on the same pages, run in
    SGLang's environment (`movers_sglang.py`; `make setup` builds it)."""
    from cpcache.testing.sglang_cpu.servers import CPU_HOST, sglang_interpreter

    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(CPU_HOST), str(root)])}
    done = subprocess.run([sglang_interpreter(), "-m", "cpcache.tools.bench.movers_sglang", str(blocks)],
                          capture_output=True, text=True, env=env, cwd=root, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench movers --against sglang: SGLang's side failed:\n{done.stderr[-3000:]}")
    rows: list[dict] = json.loads(done.stdout.strip().splitlines()[-1])["movers"]
    return rows


def main(args: argparse.Namespace) -> int:
    blocks = getattr(args, "repeat", REPEATS)
    mooncake_only = getattr(args, "mooncake_only", False)
    if mooncake_only and getattr(args, "no_mooncake", False):
        raise SystemExit("bench movers: --mooncake-only and --no-mooncake leave nothing to measure")
    report = run(with_mooncake=not getattr(args, "no_mooncake", False), blocks=blocks,
                 device_only=getattr(args, "device_only", False), mooncake_only=mooncake_only)
    if getattr(args, "against", None) == "sglang":
        report["against_sglang"] = against_sglang(blocks)
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    return 0
