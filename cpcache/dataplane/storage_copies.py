"""The movers between host and storage: a backup (host -> storage) and a
prefetch (storage -> host), each page handed to the backend as one buffer,
through contiguous bounce pages where the host layout scatters a page's
parts. A job's result counts the longest prefix of its pages that completed."""

from __future__ import annotations

import torch

from cpcache.dataplane.pools import HostPool
from cpcache.dataplane.storage import PageBuffer, StorageBackend
from cpcache.dataplane.transfer_jobs import Tiers, TransferJob, TransferResult, prefix_done


def _storage(tiers: Tiers) -> StorageBackend:
    assert tiers.storage is not None, "no storage backend is configured"
    return tiers.storage


def _staged(tiers: Tiers, slots: list[int]) -> tuple[list[PageBuffer], torch.Tensor]:
    """Contiguous bounce pages, as bytes, for a layout whose pages are scattered."""
    page_bytes = tiers.host.geometry.page_bytes
    stage = torch.empty((len(slots), page_bytes), dtype=torch.uint8)
    flat = stage.numpy()
    buffers = [PageBuffer(stage[i].data_ptr(), flat[i]) for i in range(len(slots))]
    return buffers, stage


def _stored_runs(host: HostPool, staged_page: torch.Tensor, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(host view, staged view) of each part of a page, both as bytes in stored order."""
    pairs, start = [], 0
    for on_host in host.stored_bytes(slot):
        size = on_host.numel()
        pairs.append((on_host, staged_page[start : start + size].view(on_host.shape)))
        start += size
    return pairs


def host_to_storage(tiers: Tiers, job: TransferJob) -> TransferResult:
    slots, keys = list(job.src), list(job.dst)
    if tiers.host.contiguous_pages:
        done = _storage(tiers).put_from(keys, tiers.host_buffers(slots))
    else:
        buffers, stage = _staged(tiers, slots)
        for i, slot in enumerate(slots):
            for on_host, staged in _stored_runs(tiers.host, stage[i], slot):
                staged.copy_(on_host)
        done = _storage(tiers).put_from(keys, buffers)
    n = prefix_done(done)
    return TransferResult(job.job_id, n == len(keys), n)


def storage_to_host(tiers: Tiers, job: TransferJob) -> TransferResult:
    keys, slots = list(job.src), list(job.dst)
    if tiers.host.contiguous_pages:
        done = _storage(tiers).get_into(keys, tiers.host_buffers(slots))
    else:
        buffers, stage = _staged(tiers, slots)
        done = _storage(tiers).get_into(keys, buffers)
        for i, slot in enumerate(slots[: prefix_done(done)]):
            for on_host, staged in _stored_runs(tiers.host, stage[i], slot):
                on_host.copy_(staged)
    n = prefix_done(done)
    return TransferResult(job.job_id, n == len(keys), n)
