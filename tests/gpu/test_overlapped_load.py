"""The overlapped load-back on a GPU (`cpcache/testing/layer_overlap.py`):
SGLang-shaped per-layer CUDA buffers attached by IPC handle, the daemon
recording an IPC event per layer on its copy stream, a stand-in forward
whose layer l waits only for layer l (its stream on the event, the host
only for the queueing), reading what was written, timed against the
blocking load-back in interleaved blocks with copies slowed to 20 ms per
layer. Figures go to `$CPCACHE_GPU_FIGURES` (a JSON file) when set:
`services/gpu-driver/run.sh` puts them in its summary."""

import json
import os

import pytest
import torch

from cpcache.testing import layer_overlap

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(180),
]


async def test_overlapped_load_back_waits_per_layer_and_beats_the_blocking_load(run_dir):
    figures = await layer_overlap.measure(run_dir, "cuda", blocks=4)
    print("overlapped load-back:", json.dumps(figures))
    if os.environ.get("CPCACHE_GPU_FIGURES"):
        with open(os.environ["CPCACHE_GPU_FIGURES"], "w") as out:
            json.dump(figures, out)
    # Layer 0 was read once its own copy landed, long before the last layer's.
    assert figures["layer_0_readable_after_ms"] < (figures["layers"] - 1) * figures["layer_delay_ms"] / 2, figures
    assert figures["ratio"] < 1.0, figures
