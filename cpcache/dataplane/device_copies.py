"""The movers between device and host: a write-through (device -> host) and
a load-back (host -> device), every layer of every part of the pages, by
gather / scatter where the pages are scattered and run by run otherwise. A
load-back a forward may already be reading goes layer by layer, each layer
published on the device pool's load-signal board once it has landed."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from cpcache.dataplane import gather
from cpcache.dataplane.pools import DevicePool, HostPool, runs
from cpcache.dataplane.transfer_jobs import Tiers, TransferJob, TransferResult

GPU_CYCLES_PER_MS = 1_500_000  # an injected device-side delay's clock: about 1.5 GHz


def _device(job: TransferJob) -> DevicePool:
    assert job.device is not None, "the job was issued without a device pool"
    return job.device


def _copy_layers(device: DevicePool, host: HostPool, host_pages: Iterable[int], device_pages: Iterable[int],
                 to_device: bool) -> None:
    """Every layer of every part of the pages (`DevicePool.parts`)."""
    host_pages, device_pages = list(host_pages), list(device_pages)
    for device_part, host_part in zip(device.parts, host.parts, strict=True):
        _copy_part(device_part, host_part, host_pages, device_pages, to_device)


def _copy_part(device: DevicePool, host: HostPool, host_pages: list[int], device_pages: list[int],
               to_device: bool) -> None:
    """Every layer of one part of the pages, by gather / scatter where they
    are scattered (`gather.gathers`), run by run otherwise: the device
    pool's layers lie wherever their creator put them."""
    spans = runs(host_pages, device_pages)
    if not gather.gathers(device.geometry, len(host_pages), len(spans), device_pages if to_device else host_pages):
        _copy_runs(device, host, spans, to_device)
        return
    index = gather.PageIndex.of(device, host_pages, device_pages)
    if not to_device:
        gather.store(device, host, index)
        return
    for layer in range(device.geometry.layers):
        gather.load_layer(device, host, index, layer)


def _copy_runs(device: DevicePool, host: HostPool, spans: list[tuple[int, int, int]], to_device: bool) -> None:
    """One copy per layer per run of pages consecutive on both sides."""
    for h, d, n in spans:
        host_view = host.page_view(h, n)  # [layers, components, n, page_size, heads, head_dim]
        for layer in range(device.geometry.layers):
            on_device = device.layer_pages(layer, d, n)
            if to_device:
                on_device.copy_(host_view[layer], non_blocking=True)
            else:
                host_view[layer].copy_(on_device, non_blocking=True)


def device_to_host(tiers: Tiers, job: TransferJob) -> TransferResult:
    device = _device(job)
    try:
        _copy_layers(device, tiers.host, job.dst, job.src, to_device=False)
    finally:  # copies already queued must end before the slots count as idle
        device.synchronize()
    return TransferResult(job.job_id, True, len(job.src))


def host_to_device(tiers: Tiers, job: TransferJob) -> TransferResult:
    device = _device(job)
    try:
        if job.signal[0] or job.layer_faults is not None:
            _load_layer_by_layer(device, tiers.host, job)
        else:
            _copy_layers(device, tiers.host, job.src, job.dst, to_device=True)
    finally:  # copies already queued must end before the slots count as idle
        device.synchronize()
    return TransferResult(job.job_id, True, len(job.src))


def _load_layer_by_layer(device: DevicePool, host: HostPool, job: TransferJob) -> None:
    """A load-back a forward may already be reading: all of layer 0's pages
    (every part of them), then layer 1's, ..., each layer published once its
    copies are done. On a CUDA device every layer is queued first, its event
    recorded after its copies, then each is published once its event has
    completed: the board says landed, never queued, so a scheduler whose
    daemon dies mid-load trusts only layers that are there (it copies the
    rest itself), and its forward never waits on an event a dead context
    would not complete."""
    loaders = [_layer_loader(device_part, host_part, list(job.src), list(job.dst))
               for device_part, host_part in zip(device.parts, host.parts, strict=True)]
    slot, op = job.signal
    signals = device.signals if slot else None
    stream = torch.cuda.current_stream(device.layers[0].device) if device.is_cuda else None
    for layer in range(device.geometry.layers):
        if job.layer_faults is not None:
            # On a CUDA device the injected delay runs on the copy stream:
            # the layer is queued (and published) at once and lands later.
            job.layer_faults.before_layer(layer, on_host=stream is None)
            if stream is not None and job.layer_faults.delay_ms:
                with torch.cuda.stream(stream):  # the pool's device and stream, not this thread's current ones
                    torch.cuda._sleep(int(job.layer_faults.delay_ms * GPU_CYCLES_PER_MS))
        for copy_layer in loaders:
            copy_layer(layer)
        if signals is not None:
            if signals.events is not None:
                signals.events[slot - 1][layer].record(stream)
            else:
                signals.publish(slot, op, layer + 1)
    if signals is not None and signals.events is not None:
        for layer, event in enumerate(signals.events[slot - 1]):
            event.synchronize()
            signals.publish(slot, op, layer + 1)


def _layer_loader(device: DevicePool, host: HostPool, host_pages: list[int],
                  device_pages: list[int]) -> Callable[[int], None]:
    """What copies one layer of one part of a load: one gather / scatter
    where the pages are scattered (`gather.gathers`), one copy per run
    otherwise."""
    spans = runs(host_pages, device_pages)
    if gather.gathers(device.geometry, len(host_pages), len(spans), device_pages):
        index = gather.PageIndex.of(device, host_pages, device_pages)
        return lambda layer: gather.load_layer(device, host, index, layer)
    views = [(host.page_view(h, n), d, n) for h, d, n in spans]

    def copy_runs(layer: int) -> None:
        for host_view, d, n in views:
            device.layer_pages(layer, d, n).copy_(host_view[layer], non_blocking=True)

    return copy_runs
