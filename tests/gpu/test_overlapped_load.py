"""The overlapped load-back on a GPU: a forward whose layer l waits only for
layer l of the load (the daemon records an IPC event per layer on its copy
stream; the forward's stream waits on it, the host only for the queueing),
what it reads equal to what was written, and its time against the blocking
load-back (the whole load decided before the forward), interleaved blocks.
The copies are slowed layer by layer on the daemon (fault injection), so
that the overlap is there to see. Figures go to `$CPCACHE_GPU_FIGURES` (a
JSON file) when set: `services/gpu-driver/run.sh` puts them in its summary."""

import json
import os
import statistics
import time

import pytest
import torch

from cpcache.client import Client, SchedulerSession
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.integrations.sglang.layer_loads import LayerLoads
from cpcache.topology import Topology
from tests.gpu.cuda import GEOMETRY, PAGE_KEYS, cuda_layers, layer_regions, pages_of

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(180),
]

LAYER_DELAY_MS = 20.0
BLOCKS = 4
SOURCE, TARGET = [0, 1, 2, 3], [8, 9, 10, 11]


def _forward(layers: list[torch.Tensor], loads: LayerLoads, weight: torch.Tensor) -> tuple[list, list[float]]:
    """A stand-in for the model: per layer, wait for the layer (SGLang's
    get_key_buffer does), read the loaded rows, compute a while. -> each
    layer's checksum (on the device) and when its wait returned."""
    sums, ready = [], []
    s = GEOMETRY.page_size
    for index, layer in enumerate(layers):
        loads.wait_until(index)
        ready.append(time.perf_counter())
        rows = layer[:, TARGET[0] * s : (TARGET[-1] + 1) * s]
        sums.append(rows.float().sum())
        x = weight
        for _ in range(8):  # some work per layer, as attention and the MLP would
            x = torch.tanh(x @ weight)
        sums[-1] = sums[-1] + 0 * x.sum()
    return sums, ready


async def test_overlapped_load_back_waits_per_layer_and_beats_the_blocking_load(run_dir):
    layers = cuda_layers(16, random=False)
    for layer in layers:
        layer.normal_()  # finite values: the checksums compare
    expected = [float(v.float().sum()) for v in pages_of(layers, SOURCE[0], len(SOURCE))]
    weight = torch.randn(2048, 2048, device="cuda") / 64
    spec = DomainSpec(Topology(tp=1), run_dir,
                      extra=dict(host_pool_pages=16, fault_copy_layer_delay_ms=LAYER_DELAY_MS))
    times: dict[str, list[float]] = {"overlapped": [], "blocking": []}
    spread: list[float] = []
    async with LocalDomain(spec) as domain:
        loads = LayerLoads(GEOMETRY.layers, timeout_s=30, cuda_device=torch.device("cuda", 0), slots=4)
        with Client(domain.sockets[0], timeout_s=30) as client:
            client.attach("gpu-test", GEOMETRY, 16, regions=layer_regions(layers), load_signals=loads.signals,
                          cuda_events=loads.event_handles())
            loads.signals.close_fd()
            session = SchedulerSession(client, first_step=client.status().last_step + 1)
            acked: list[bool] = []
            session.write_through(PAGE_KEYS, SOURCE, done=acked.append)
            while not acked:
                session.flush()
            assert acked == [True]
            for block in range(BLOCKS):
                for mode in ("overlapped", "blocking") if block % 2 == 0 else ("blocking", "overlapped"):
                    for layer in layers:
                        layer[:, TARGET[0] * GEOMETRY.page_size : (TARGET[-1] + 1) * GEOMETRY.page_size].zero_()
                    torch.cuda.synchronize()
                    started = time.perf_counter()
                    if mode == "overlapped":
                        opened = session.load_opened(PAGE_KEYS, TARGET, loads.signals)
                        assert opened is not None
                        loads.opened(*opened)
                        loads.set_consumer(loads.start_batch())
                    else:
                        assert session.load_now(PAGE_KEYS, TARGET)
                        loads.set_consumer(-1)
                    sums, ready = _forward(layers, loads, weight)
                    torch.cuda.synchronize()
                    times[mode].append(time.perf_counter() - started)
                    assert [float(v) for v in sums] == pytest.approx(expected, rel=1e-3), mode
                    if mode == "overlapped":
                        # Layer 0 was read while the later layers were still being copied.
                        spread.append(ready[-1] - ready[0])
                    while session.busy():
                        session.flush()
                    loads.forget_decided(session.load_pending)
                    loads.reset()
    layers_n = GEOMETRY.layers
    assert statistics.median(spread) >= 0.5 * (layers_n - 1) * LAYER_DELAY_MS / 1000, spread
    figures = {
        "layers": layers_n, "layer_delay_ms": LAYER_DELAY_MS, "blocks": BLOCKS,
        "overlapped_ms": round(1000 * statistics.median(times["overlapped"]), 2),
        "blocking_ms": round(1000 * statistics.median(times["blocking"]), 2),
        "ratio": round(statistics.median(times["overlapped"]) / statistics.median(times["blocking"]), 3),
        "first_to_last_layer_ready_ms": round(1000 * statistics.median(spread), 2),
    }
    print("overlapped load-back:", json.dumps(figures))
    if os.environ.get("CPCACHE_GPU_FIGURES"):
        with open(os.environ["CPCACHE_GPU_FIGURES"], "w") as out:
            json.dump(figures, out)
    assert figures["ratio"] < 1.0, figures
