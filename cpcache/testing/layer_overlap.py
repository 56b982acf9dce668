"""The overlapped load-back's mechanism, measured without an inference
server: a real daemon loads pages into a pool while a stand-in forward
reads them layer by layer, as SGLang's KV pool does through its
layer-transfer counter (`LayerLoads`), against the blocking load-back
(the whole load decided, then the forward), in interleaved blocks.

The daemon's copy is slowed to `layer_delay_ms` per layer (fault
injection) and the stand-in computes about `compute_ms` per layer after
reading its layer, so the figure says what overlapping a copy with a
forward of that shape saves: about (L + 1) / 2L of the blocking time when
both are equal. On a CUDA device the pool is per-layer CUDA buffers shared
by IPC handle, the injected delay runs on the daemon's copy stream (a layer
is published as soon as it is queued), and the forward's stream waits on
the daemon's per-layer events, so what it reads is right only if those
waits are; elsewhere the pool is a sealed memfd and the forward waits on
the board.
What it reads is checked against what was written, every block.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cpcache.client import Client, SchedulerSession
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.dataplane.pools import DevicePool
from cpcache.geometry import KVGeometry
from cpcache.integrations.sglang.layer_loads import LayerLoads, OpenLoad
from cpcache.topology import Topology

GEOMETRY = KVGeometry(layers=8, kv_kind="mha", heads=8, head_dim=128, dtype="bfloat16", page_size=16)
PAGES = 16
KEYS = [bytes([i + 1]) * 32 for i in range(4)]
SOURCE, TARGET = [0, 1, 2, 3], [8, 9, 10, 11]


def _pool(device: str) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """The scheduler's KV buffers (one [components, rows, heads, head_dim]
    tensor per layer) and how to attach them."""
    if device == "cuda":
        from cpcache.geometry import Region
        from cpcache.integrations.sglang.pool import cuda_ipc_fields

        shape = (GEOMETRY.components, PAGES * GEOMETRY.page_size, GEOMETRY.heads, GEOMETRY.head_dim)
        layers = [torch.randn(shape, device="cuda").to(GEOMETRY.torch_dtype) for _ in range(GEOMETRY.layers)]
        regions = [Region(t.data_ptr() - t.untyped_storage().data_ptr(), tuple(t.stride()),
                          cuda_ipc_fields(t.untyped_storage())) for t in layers]
        return layers, {"regions": regions}
    pool = DevicePool.create_sealed(GEOMETRY, PAGES)
    for layer in pool.layers:
        layer.copy_(torch.randn(layer.shape).to(GEOMETRY.torch_dtype))
    return pool.layers, {"pool_fd": pool.fd, "_keep": pool}


def _rows(layer: torch.Tensor, pages: list[int]) -> torch.Tensor:
    s = GEOMETRY.page_size
    return layer[:, pages[0] * s : (pages[-1] + 1) * s]


def _calibrated(compute_ms: float, device: str) -> Callable[[], torch.Tensor]:
    """A piece of work of about `compute_ms` on `device` (a layer's compute)."""
    weight = torch.randn(256, 256, device=device) / 16

    def work(n: int) -> torch.Tensor:
        x = weight
        for _ in range(n):
            x = torch.tanh(x @ weight)
        return x

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    work(1)  # the first matmul loads its library (cuBLAS on CUDA): not a layer's cost
    sync()
    started = time.perf_counter()
    work(20)
    sync()
    per = (time.perf_counter() - started) / 20
    n = max(1, round(compute_ms / 1000 / per))
    return lambda: work(n)


def _forward(layers: list[torch.Tensor], loads: LayerLoads, work: Callable[[], torch.Tensor]) -> tuple[list, float]:
    """Per layer: wait for it, read the loaded rows, compute. -> the rows'
    checksums and how long after the start layer 0 was readable."""
    started = time.perf_counter()
    sums, first_ready = [], 0.0
    for index, layer in enumerate(layers):
        loads.wait_until(index)
        if index == 0:
            first_ready = time.perf_counter() - started
        sums.append(_rows(layer, TARGET).float().sum() + 0 * work().sum())
    return sums, first_ready


async def measure(run_dir: Path, device: str = "cpu", blocks: int = 6, layer_delay_ms: float = 20.0,
                  compute_ms: float = 20.0) -> dict:
    """Overlapped and blocking load-backs of 4 pages, each followed by the
    stand-in forward, alternating first from block to block: -> the figures."""
    layers, attach = _pool(device)
    expected = [float(_rows(t, SOURCE).float().sum()) for t in layers]
    work = _calibrated(compute_ms, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    spec = DomainSpec(Topology(tp=1), run_dir,
                      extra=dict(host_pool_pages=16, fault_copy_layer_delay_ms=layer_delay_ms))
    times: dict[str, list[float]] = {"overlapped": [], "blocking": []}
    first: list[float] = []
    forwards: list[float] = []  # the blocking forwards alone: what a layer's compute took
    async with LocalDomain(spec) as domain:
        cuda = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else None
        loads = LayerLoads(GEOMETRY.layers, timeout_s=30, cuda_device=cuda, slots=4)
        with Client(domain.sockets[0], timeout_s=30) as client:
            client.attach("layer-overlap", GEOMETRY, PAGES, pool_fd=attach.get("pool_fd", -1),
                          regions=attach.get("regions", ()), load_signals=loads.signals,
                          cuda_events=loads.event_handles())
            loads.signals.close_fd()
            session = SchedulerSession(client, first_step=client.status().last_step + 1)
            stored: list[bool] = []
            session.write_through(KEYS, SOURCE, done=stored.append)
            while not stored:
                session.flush()
            assert stored == [True], "the pages were not written to the host pool"
            for block in range(blocks):
                for mode in ("overlapped", "blocking") if block % 2 == 0 else ("blocking", "overlapped"):
                    for layer in layers:
                        _rows(layer, TARGET).zero_()
                    sync()
                    started = time.perf_counter()
                    if mode == "overlapped":
                        opened = session.load_opened(KEYS, TARGET, loads.signals)
                        assert opened is not None, "the load did not open"
                        loads.opened(OpenLoad(*opened))
                        loads.set_consumer(loads.start_batch())
                    else:
                        assert session.load_now(KEYS, TARGET), "the load failed"
                        loads.set_consumer(-1)
                    forward_started = time.perf_counter()
                    sums, ready = _forward(layers, loads, work)
                    sync()
                    times[mode].append(time.perf_counter() - started)
                    if mode == "blocking":
                        forwards.append(time.perf_counter() - forward_started)
                    got = [float(v) for v in sums]
                    assert all(abs(g - e) <= 1e-3 * max(1.0, abs(e)) for g, e in zip(got, expected)), \
                        f"{mode}: the forward read {got}, the pages written sum to {expected}"
                    if mode == "overlapped":
                        first.append(ready)
                    while session.busy():
                        session.flush()
                    loads.forget_decided(session.load_pending)
                    loads.reset()
    overlapped, blocking = statistics.median(times["overlapped"]), statistics.median(times["blocking"])
    n, d, c = GEOMETRY.layers, layer_delay_ms / 1000, statistics.median(forwards) / GEOMETRY.layers
    # A perfect overlap: layer l computes once it landed and layer l - 1 is computed.
    ideal = d + (n - 1) * max(d, c) + c
    return {
        "device": device, "layers": n, "layer_delay_ms": layer_delay_ms, "compute_ms_per_layer": round(1000 * c, 2),
        "blocks": blocks, "overlapped_ms": round(1000 * overlapped, 2), "blocking_ms": round(1000 * blocking, 2),
        "ratio": round(overlapped / blocking, 3), "ideal_ratio": round(ideal / (n * d + n * c), 3),
        "layer_0_readable_after_ms": round(1000 * statistics.median(first), 2),
    }
