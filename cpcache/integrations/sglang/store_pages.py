"""Pages of an SGLang host pool put into, and read from, the store of a
cpcache domain directly, under the keys and in the frames its daemons use:
what SGLang's decode offload writes there is what the prefill's daemons read
as storage hits (the previous turn's answer), and the other way round.

A stored page is in cpcache's stored order, [components, layers, page_size,
heads, head_dim] (`HostPool`), whatever SGLang's host layout: each page goes
through a staging copy of at most `STAGE_PAGES` pages at a time, registered
with the store once (Mooncake's transfer engine reads and writes it in
place). The backend frames and checks every page (header, geometry
fingerprint, checksum; the file backend's atomic rename), so a torn,
foreign or damaged object reads as a miss, never as KV.

No SGLang import here: `storage.CpcacheStore` adapts this to SGLang's
storage interface; `host_pool_geometry` and `page_slots` read SGLang's host
pool and host indices.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import torch

from cpcache import host_layout
from cpcache.config import DaemonConfig, FaultInjection
from cpcache.dataplane.storage import PageBuffer, StorageBackend
from cpcache.dataplane.storage.configured import open_storage
from cpcache.domain_file import domain_config
from cpcache.errors import InvalidArgument
from cpcache.geometry import KVGeometry
from cpcache.integrations.sglang.flush_records import FlushRecords, RecordPage
from cpcache.integrations.sglang.pool import dtype_name
from cpcache.integrations.sglang.store_calls import CallGuard
from cpcache.keys import ShardingSpec, generation_pages

STAGE_PAGES = 16  # pages one staging copy holds: a batch larger than this goes in parts


class _Stage:
    """A staging area of pages in stored order, one call at a time."""

    def __init__(self, geometry: KVGeometry, pages: int) -> None:
        g = geometry
        self.pages = torch.zeros((pages, g.components, g.layers, g.page_size, g.heads, g.head_dim),
                                 dtype=g.torch_dtype)
        self.bytes = self.pages.view(-1).view(torch.uint8).numpy()
        self.base = self.pages.data_ptr()
        self.page_bytes = g.page_bytes
        self.lock = threading.Lock()

    @property
    def region(self) -> tuple[int, int]:
        return self.base, self.bytes.nbytes

    def buffer(self, i: int) -> PageBuffer:
        start = i * self.page_bytes
        return PageBuffer(self.base + start, self.bytes[start : start + self.page_bytes])


class StorePages:
    """One rank's view of the store: SGLang page hashes in, storage keys of
    this rank's sharding out; pages moved between the store and `host` (an
    SGLang host pool's buffer, viewed in `layout` by `cpcache.host_layout`)."""

    def __init__(self, backend: StorageBackend, sharding: ShardingSpec, geometry: KVGeometry,
                 host: torch.Tensor, layout: str, stages: tuple[_Stage, _Stage], records: FlushRecords) -> None:
        self.backend = backend
        self.records = records
        self.sharding = sharding
        self.geometry = geometry
        self.host = host
        self.layout = layout
        self._put_stage, self._get_stage = stages

    @staticmethod
    def open(config: DaemonConfig, geometry: KVGeometry, sharding: ShardingSpec, host: torch.Tensor,
             layout: str, stage_pages: int = STAGE_PAGES) -> StorePages:
        """Over the store `config` names (a domain's settings, `domain_config`)."""
        # The page count sits at dim 1 (page_first_direct's pages, page_first's
        # tokens) or dim 2 (layer_first's tokens).
        count = host.shape[2 if layout == "layer_first" else 1] if host.dim() > 2 else 0
        pages = count if layout == "page_first_direct" else count // geometry.page_size
        expected = host_layout.host_shape(geometry, pages, layout)
        if tuple(host.shape) != expected or host.dtype != geometry.torch_dtype:
            raise InvalidArgument(f"store: a host pool of shape {tuple(host.shape)} ({host.dtype}) is not the "
                                  f"{layout} layout of {geometry} (expected {expected})")
        stages = (_Stage(geometry, stage_pages), _Stage(geometry, stage_pages))
        record = RecordPage(geometry.page_bytes)
        backend = open_storage(config, geometry, [*(stage.region for stage in stages), record.region])
        if backend is None:
            raise InvalidArgument("store: the domain's settings say storage = \"none\"; there is no store to use")
        return StorePages(backend, sharding, geometry, host, layout, stages,
                          FlushRecords(backend, sharding.tenant, record))

    def keys(self, hashes: Sequence[str]) -> list[str]:
        """The storage keys of SGLang's page hashes, named as the prefill
        server names them after its newest published flush (flush_records.py)."""
        return [self.sharding.storage_key(h) for h in generation_pages(list(hashes), self.records.latest())]

    def exists_prefix(self, hashes: Sequence[str]) -> int:
        """How many pages, from the first, the store holds for this rank."""
        return self.backend.exists_prefix(self.keys(hashes))

    def put(self, hashes: Sequence[str], slots: Sequence[int], guard: CallGuard | None = None) -> list[bool]:
        """Write each host slot's page under its hash. The caller chose this
        rank as the pages' writer (SGLang writes a replicated page from one
        rank): every page given is written. `guard`: once its caller gave
        up, no host slot is read (the rest are not written)."""
        done = [False] * len(hashes)
        stage = self._put_stage
        guard = guard or CallGuard()
        keys = self.keys(hashes)
        with stage.lock:
            for part in _parts(list(range(len(hashes))), len(stage.pages)):
                with guard.host_slots() as waited:
                    if not waited:
                        return done
                    for j, i in enumerate(part):
                        stage.pages[j].copy_(self._stored_view(slots[i]))
                written = self.backend.put_from([keys[i] for i in part], [stage.buffer(j) for j in range(len(part))])
                for i, ok in zip(part, written):
                    done[i] = ok
        return done

    def get(self, hashes: Sequence[str], slots: Sequence[int], guard: CallGuard | None = None) -> list[bool]:
        """Read each hash's page into its host slot; from the first miss on,
        nothing more is read (a prefix is all a hit can use). `guard`: once
        its caller gave up, no host slot is written."""
        done = [False] * len(hashes)
        stage = self._get_stage
        guard = guard or CallGuard()
        keys = self.keys(hashes)
        with stage.lock:
            for part in _parts(list(range(len(hashes))), len(stage.pages)):
                read = self.backend.get_into([keys[i] for i in part], [stage.buffer(j) for j in range(len(part))])
                with guard.host_slots() as waited:
                    for j, (i, ok) in enumerate(zip(part, read)):
                        if not (ok and waited):
                            return done
                        self._stored_view(slots[i]).copy_(stage.pages[j])
                        done[i] = True
        return done

    def _stored_view(self, slot: int) -> torch.Tensor:
        return host_layout.stored_page(self.host, self.geometry, self.layout, slot)

    def close(self) -> None:
        self.backend.close()


def client_config(domain_file: str, store_hostname: str = "") -> DaemonConfig:
    """The domain's store as a process without a daemon reaches it: no part
    of the store in its memory (its writes land in the daemons' segments),
    none of the daemons' fault injection; `store_hostname`: its own address
    (empty: the file's)."""
    config = domain_config(domain_file)
    return dataclasses.replace(config, faults=FaultInjection(), storage_segment_bytes=0,
                               storage_local_hostname=store_hostname or config.storage_local_hostname)


def open_flush_records(config: DaemonConfig, geometry: KVGeometry, tenant: str) -> FlushRecords:
    """The flush records of `tenant` in the store `config` names (what a
    prefill server publishes them through)."""
    page = RecordPage(geometry.page_bytes)
    backend = open_storage(config, geometry, [page.region])
    if backend is None:
        raise InvalidArgument("store: the domain's settings say storage = \"none\"; there is no store to use")
    return FlushRecords(backend, tenant, page)


def host_pool_geometry(host_pool: Any) -> tuple[KVGeometry, torch.Tensor]:
    """The KV geometry of an SGLang MHA or MLA host pool, and its buffer with
    the K/V component outermost (`cpcache.host_layout`); refuses what a page
    of that geometry would not hold whole (scale buffers, draft layers)."""
    if getattr(host_pool, "layer_num", 0) != getattr(host_pool, "target_layer_num", host_pool.layer_num):
        raise InvalidArgument("store: a host pool with draft-model layers is not supported")
    if any(getattr(info, "scales", None) is not None for info in getattr(host_pool, "_buffer_infos", ())):
        raise InvalidArgument("store: a quantized host pool (KV scale buffers) is not supported")
    dtype = dtype_name(host_pool.dtype)
    if hasattr(host_pool, "kv_lora_rank"):  # MLA: one latent, [..., 1, kv_cache_dim] per token
        geometry = KVGeometry(layers=host_pool.layer_num, kv_kind="mla", heads=1, head_dim=host_pool.kv_cache_dim,
                              dtype=dtype, page_size=host_pool.page_size)
        return geometry, host_pool.kv_buffer.unsqueeze(0)
    if host_pool.v_head_dim != host_pool.head_dim:
        raise InvalidArgument(f"store: MHA with v_head_dim {host_pool.v_head_dim} != head_dim "
                              f"{host_pool.head_dim} is not supported")
    geometry = KVGeometry(layers=host_pool.layer_num, kv_kind="mha", heads=host_pool.head_num,
                          head_dim=host_pool.head_dim, dtype=dtype, page_size=host_pool.page_size)
    return geometry, host_pool.kv_buffer


def page_slots(host_indices: torch.Tensor, pages: int, page_size: int) -> list[int]:
    """Host slots of `pages` pages from their token indices (SGLang's host
    allocator gives pages whole: each page's first index is a multiple of
    `page_size`)."""
    firsts = host_indices.reshape(-1)[: pages * page_size : page_size]
    return [int(i) // page_size for i in firsts.tolist()]


def _parts(items: list[int], size: int) -> list[list[int]]:
    return [items[i : i + size] for i in range(0, len(items), size)]
