"""Device <-> host copies layer by layer (`_copy_layers` of `cpcache/dataplane/device_copies.py`: one
gather / scatter per layer where the pages are scattered, one copy per
layer per run of pages consecutive on both sides otherwise) against one
strided copy per run over all layers at once (what the movers did before the
device pool became per-layer regions; possible only where the layers lie at
one stride in one memory), and against run-by-run copies alone (`_copy_runs`,
what the movers did on scattered pages before gathers). Same pools, the
three alternated in blocks; pages consecutive (one run per batch) or
scattered (device pages shuffled: one run per page; with `--shuffle-host`
the host slots too, so that neither side is one run). On a host without CUDA
the device pool is a shared-memory file.

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_layer_copies.py [--blocks 5] [--shuffle-host]

Prints one JSON object per case; `per_layer_over_strided` is the median over
the blocks of the movers' rate over the strided path's (below 1: the movers
are slower), `runs_over_strided` the same for run-by-run copies; `gathered`
says which way the movers went.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from cpcache.dataplane import gather
from cpcache.dataplane.device_copies import _copy_layers, _copy_runs
from cpcache.dataplane.pools import DevicePool, HostPool, runs
from cpcache.geometry import KVGeometry

BATCH_BYTES = 64 << 20
# (layers, tokens per page): the movers bench's geometry (4 layers, 64 KiB,
# 1 MiB, 4 MiB pages) and a 36-layer model (8 KV heads x 128, bf16) with
# 1-token and 16-token pages.
CASES = [(4, 4), (4, 64), (4, 256), (36, 1), (36, 16)]


def strided_copy(device: DevicePool, host: HostPool, host_pages: list[int], device_pages: list[int],
                 to_device: bool) -> None:
    whole, s = device.tensor, device.geometry.page_size
    for h, d, n in runs(host_pages, device_pages):
        on_device = whole[:, :, d * s : (d + n) * s].unflatten(2, (n, s))
        if to_device:
            on_device.copy_(host.page_view(h, n), non_blocking=True)
        else:
            host.page_view(h, n).copy_(on_device, non_blocking=True)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def case(layers: int, tokens: int, scattered: bool, blocks: int, shuffle_host: bool = False) -> dict:
    g = KVGeometry(layers=layers, kv_kind="mha", heads=8, head_dim=128, dtype="bfloat16", page_size=tokens)
    n = max(8, BATCH_BYTES // g.page_bytes)
    device = DevicePool.create_sealed(g, pages=n)
    device.tensor.view(-1).view(torch.uint8).random_(0, 256)
    host = HostPool(g, pages=n, layout="page_first_direct")
    host_pages, device_pages = list(range(n)), list(range(n))
    if scattered:
        random.Random(0).shuffle(device_pages)
        if shuffle_host:
            random.Random(1).shuffle(host_pages)
    spans = runs(host_pages, device_pages)
    copies = len(spans)
    out: dict = {"layers": layers, "page_bytes": g.page_bytes, "pages": n, "scattered": scattered,
                 "host_shuffled": scattered and shuffle_host,
                 "strided_copies": copies, "per_layer_copies": copies * layers,
                 "gathered": gather.gathers(g, n, copies, device_pages)}
    for name, to_device in (("device->host", False), ("host->device", True)):
        strided, per_layer, by_runs = [], [], []
        old = partial(strided_copy, device, host, host_pages, device_pages, to_device)
        new = partial(_copy_layers, device, host, host_pages, device_pages, to_device)
        def run_by_run(to_device: bool = to_device) -> None:  # finding the runs included, as the movers do
            _copy_runs(device, host, runs(host_pages, device_pages), to_device)

        for _ in range(blocks):
            strided.append(timed(old))
            per_layer.append(timed(new))
            by_runs.append(timed(run_by_run))
        ratios = sorted(s / p for s, p in zip(strided, per_layer))
        out[name] = {"strided_ms": round(statistics.median(strided) * 1e3, 2),
                     "per_layer_ms": round(statistics.median(per_layer) * 1e3, 2),
                     "runs_ms": round(statistics.median(by_runs) * 1e3, 2),
                     "per_layer_over_strided": round(statistics.median(ratios), 3),
                     "spread": [round(ratios[0], 3), round(ratios[-1], 3)],
                     "runs_over_strided": round(statistics.median(s / r for s, r in zip(strided, by_runs)), 3)}
    host.tensor.zero_()  # the movers' path moved the right bytes, both ways
    _copy_layers(device, host, host_pages, device_pages, False)
    check(device, host, host_pages, device_pages, tokens)
    host.tensor.view(torch.int16).random_(-(2**15), 2**15 - 1)
    _copy_layers(device, host, host_pages, device_pages, True)
    check(device, host, host_pages, device_pages, tokens)
    return out


def check(device: DevicePool, host: HostPool, host_pages: list[int], device_pages: list[int], tokens: int) -> None:
    n = len(device_pages)
    for i in (0, n // 2, n - 1):
        d = device_pages[i] * tokens
        moved, source = host.page_view(host_pages[i]), device.tensor[:, :, d : d + tokens].unflatten(2, (1, tokens))
        assert torch.equal(moved.view(torch.int16), source.view(torch.int16))  # bits: random bf16 holds NaNs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--shuffle-host", action="store_true", help="scatter the host slots too")
    args = parser.parse_args()
    for layers, tokens in CASES:
        for scattered in (False, True):
            print(json.dumps(case(layers, tokens, scattered, args.blocks, args.shuffle_host)), flush=True)


if __name__ == "__main__":
    main()
