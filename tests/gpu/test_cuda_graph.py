"""What CUDA graphs need from in-place sharing: a graph captured over
per-layer KV buffers shaped like SGLang's (`k_buffer[layer]`,
`v_buffer[layer]`: [tokens, heads, head_dim] each) reads what a daemon's
mover wrote into those same buffers, at the addresses it captured, and its
replays equal an eager run, also while the daemon is loading.

Each layer is its own CUDA allocation, as SGLang's, attached by the daemon
where it lies (an IPC handle per layer, captured before the attach: the
attach moves nothing, so the graph needs no re-capture); the forward is
a decode step's attention over the tokens at `loc`, layer after layer,
made of reductions only (no cuBLAS), so graph and eager replays are bit for
bit the same."""

import asyncio

import pytest
import torch

from cpcache.client import AsyncClient
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.topology import Topology
from tests.gpu.cuda import GEOMETRY, layer_regions, pages_of, start_load, write_pages

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(120),
]

PAGES = 16
SOURCE, TARGET = [0, 1, 2, 3], [8, 9, 10, 11]  # written from, loaded into
REPLAYS = 50  # at most, while the load is in flight


def kv_buffers(layers: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """SGLang's MHA pool layout: a [tokens, heads, head_dim] K and V tensor per
    layer, the halves of that layer's allocation (the memory the daemon maps)."""
    return [layer[0] for layer in layers], [layer[1] for layer in layers]


def decode(q: torch.Tensor, k_buffers: list[torch.Tensor], v_buffers: list[torch.Tensor],
           loc: torch.Tensor) -> torch.Tensor:
    """One query per head attends over the tokens at `loc`, layer after
    layer; each layer's output is the next layer's query."""
    h = q
    for k_buffer, v_buffer in zip(k_buffers, v_buffers):
        k = k_buffer.index_select(0, loc).float()  # [n, heads, head_dim]
        v = v_buffer.index_select(0, loc).float()
        weights = ((h.unsqueeze(0) * k).sum(-1) / GEOMETRY.head_dim**0.5).softmax(0)  # [n, heads]
        h = (weights.unsqueeze(-1) * v).sum(0)  # [heads, head_dim]
    return h


def tokens_of(pages: list[int]) -> torch.Tensor:
    s = GEOMETRY.page_size
    return torch.cat([torch.arange(p * s, (p + 1) * s) for p in pages]).cuda()


def capture(q: torch.Tensor, k_buffers: list, v_buffers: list, loc: torch.Tensor) -> tuple:
    """(graph, its output tensor), captured after a warm-up on a side stream
    (what torch.cuda.graph asks)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            decode(q, k_buffers, v_buffers, loc)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode(q, k_buffers, v_buffers, loc)
    return graph, out


def replayed(graph: torch.cuda.CUDAGraph, out: torch.Tensor) -> torch.Tensor:
    graph.replay()
    torch.cuda.current_stream().synchronize()
    return out.clone()


async def test_cuda_graph_replays_over_pages_a_daemon_loads_in_place(run_dir):
    shape = (GEOMETRY.components, PAGES * GEOMETRY.page_size, GEOMETRY.heads, GEOMETRY.head_dim)
    layers = [torch.randn(shape, device="cuda").to(GEOMETRY.torch_dtype) for _ in range(GEOMETRY.layers)]
    k_buffers, v_buffers = kv_buffers(layers)
    addresses = [b.data_ptr() for b in k_buffers + v_buffers]
    q = torch.randn(GEOMETRY.heads, GEOMETRY.head_dim, device="cuda")
    loc = tokens_of(SOURCE)  # the graph's input, updated in place as SGLang does its own
    graph, out = capture(q, k_buffers, v_buffers, loc)
    eager = decode(q, k_buffers, v_buffers, loc)
    assert torch.equal(replayed(graph, out), eager)

    for layer in layers:
        layer[:, tokens_of(TARGET)] = 0  # so only the load can make TARGET equal SOURCE
    async with LocalDomain(DomainSpec(Topology(tp=1), run_dir, extra=dict(host_pool_pages=16))) as domain:
        async with AsyncClient(domain.sockets[0]) as client:
            await client.attach("gpu-graph", GEOMETRY, PAGES, regions=layer_regions(layers))
            step = await write_pages(client, 1, SOURCE)
            await start_load(client, step, TARGET)
            loading = asyncio.ensure_future(client.wait_loads([2], timeout_s=30))
            # Replays of the captured graph while the daemon writes TARGET:
            # they read SOURCE, which nothing writes, and stay equal to eager.
            for _ in range(REPLAYS):
                if loading.done():
                    break
                assert torch.equal(replayed(graph, out), eager)
                await asyncio.sleep(0)  # let the load's reply in
            await loading

    assert [b.data_ptr() for b in k_buffers + v_buffers] == addresses  # nothing moved
    for loaded, written in zip(pages_of(layers, TARGET[0], len(TARGET)), pages_of(layers, SOURCE[0], len(SOURCE))):
        assert torch.equal(loaded, written)
    loc.copy_(tokens_of(TARGET))  # the same graph, now over the pages the daemon loaded
    from_graph = replayed(graph, out)
    assert torch.equal(from_graph, decode(q, k_buffers, v_buffers, loc))
    assert torch.equal(from_graph, eager)  # the loaded pages are the written ones, bit for bit
