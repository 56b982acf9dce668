"""The plain-torch stand-ins for SGLang's page_first_direct HiCache copies
(cpu_host/hicache_cpu.py), against a page-by-page reference: what SGLang's
Mooncake backend runs on in the CPU benches."""

from __future__ import annotations

import pytest
import torch

from cpcache.testing.sglang_cpu.cpu_host.hicache_cpu import (
    transfer_kv_all_layer_direct_lf_pf,
    transfer_kv_per_layer_direct_pf_lf,
)

PAGE, LAYERS, HEADS, DIM = 4, 3, 2, 5
pytestmark = pytest.mark.timeout(30)


def device_layers(tokens: int) -> list[torch.Tensor]:
    """A layer-first device pool: K layers, then V layers, each [token, head, dim]."""
    return [torch.randn(tokens, HEADS, DIM) for _ in range(2 * LAYERS)]


def host_pool(pages: int) -> list[torch.Tensor]:
    """A page_first_direct host pool: K, then V, each [page, layer, row, head, dim]."""
    return [torch.zeros(pages, LAYERS, PAGE, HEADS, DIM) for _ in range(2)]


def test_a_backup_copies_whole_pages_of_every_layer_into_their_host_pages():
    device, host = device_layers(32), host_pool(6)
    device_pages, host_pages = [5, 1], [3, 0]
    src = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in device_pages])
    dst = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in host_pages])
    transfer_kv_all_layer_direct_lf_pf(device, host, src, dst, PAGE)
    for part in range(2):
        for layer in range(LAYERS):
            for d, h in zip(device_pages, host_pages):
                assert torch.equal(host[part][h, layer], device[part * LAYERS + layer][d * PAGE:(d + 1) * PAGE])
    untouched = [p for p in range(6) if p not in host_pages]
    assert all(not host[part][p].any() for part in range(2) for p in untouched)


def test_a_load_copies_one_layer_of_host_pages_into_device_rows():
    host = [torch.randn(6, LAYERS, PAGE, HEADS, DIM) for _ in range(2)]
    device = [torch.zeros(32, HEADS, DIM) for _ in range(2)]
    src = torch.cat([torch.arange(2 * PAGE, 3 * PAGE), torch.arange(4 * PAGE, 5 * PAGE)])
    dst = torch.arange(1 * PAGE, 3 * PAGE)
    transfer_kv_per_layer_direct_pf_lf(host, device, src, dst, layer_id=1, page_size=PAGE)
    for part in range(2):
        assert torch.equal(device[part][PAGE:2 * PAGE], host[part][2, 1])
        assert torch.equal(device[part][2 * PAGE:3 * PAGE], host[part][4, 1])
        assert not device[part][:PAGE].any() and not device[part][3 * PAGE:].any()


@pytest.mark.parametrize("host_indices", [
    torch.arange(1, PAGE + 1),  # not at a page boundary
    torch.tensor([0, 1, 3, 2]),  # not through the page in order
    torch.arange(0, PAGE - 1),  # a partial page
])
def test_indices_the_kernels_would_refuse_or_misread_are_refused(host_indices):
    device, host = device_layers(16), host_pool(4)
    with pytest.raises(AssertionError):
        transfer_kv_all_layer_direct_lf_pf(device, host, torch.arange(host_indices.numel()), host_indices, PAGE)
