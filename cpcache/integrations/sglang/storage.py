"""cpcache's store as SGLang's HiCache storage backend, for the processes
that have no daemon beneath them: a decode server's KV offload
(`--disaggregation-decode-enable-offload-kvcache`) writes the pages it
generated into the prefill domain's store, under the keys the prefill's
daemons read, so the next turn's prefill finds the previous answer there.

Named by the same flags as the prefill's storage tier
(`server_flags.STORAGE_EXTRA_CONFIG`). With ``--radix-cache-backend
cpcache`` SGLang never builds this class: the rank's daemon is the storage
tier. Where SGLang does build it, it needs two of the backend's settings
(`settings.Settings`, ``CPCACHE_SGLANG_CONFIG``): `daemon_config`, the
domain's settings file (the store, its sharding), and `model_id` when the
prefill's is not the default (pages are stored under the tenant of the
model, its dtypes and its KV geometry, as the daemons store them).

SGLang imports this module only in its own processes: it subclasses
SGLang's `HiCacheStorage`.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from cpcache.domain_file import domain_config
from cpcache.geometry import KVGeometry
from cpcache.integrations.sglang.pool import dtype_name
from cpcache.integrations.sglang.settings import Settings
from cpcache.integrations.sglang.store_pages import StorePages
from cpcache.keys import ShardingSpec, tenant_of

log = logging.getLogger(__name__)


class CpcacheStore(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        extra = storage_config.extra_config or {}
        if not extra.get("interface_v1"):
            raise ValueError("cpcache: the store moves pages by host index; add \"interface_v1\": 1 to "
                             "--hicache-storage-backend-extra-config")
        if storage_config.dcp_size > 1 or storage_config.pp_size > 1:
            raise ValueError("cpcache: the store does not describe pages split by --dcp-size or --pp-size")
        self.settings = Settings.load()
        if not self.settings.daemon_config:
            raise ValueError("cpcache: the store to write is the domain's: set daemon_config, the prefill "
                             "daemons' settings file, in the file CPCACHE_SGLANG_CONFIG names")
        self.config = domain_config(self.settings.daemon_config)
        self.storage_config = storage_config
        self.pages: StorePages | None = None

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        geometry, host = host_pool_geometry(mem_pool_host)
        model_id, model_dtype = _served_model()
        sharding = ShardingSpec(
            cp=self.config.kv_cp_sharding, tp_sharded_heads=geometry.kv_kind == "mha",
            cp_rank=self.storage_config.attn_cp_rank, cp_size=self.storage_config.attn_cp_size,
            tp_rank=self.storage_config.tp_rank, tp_size=self.storage_config.tp_size,
            tenant=tenant_of(self.settings.model_id or model_id, geometry.fingerprint(), model_dtype))
        self.pages = StorePages.open(self.config, geometry, sharding, host, mem_pool_host.layout)
        log.info("cpcache: store %s for %r (%s), tenant %s, keys ending %r", self.config.storage,
                 self.settings.model_id or model_id, model_dtype, sharding.tenant, sharding.suffix())

    def _store(self) -> StorePages:
        if self.pages is None:
            raise RuntimeError("cpcache: the store is used before SGLang registered its host pool")
        return self.pages

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        return self._store().exists_prefix(keys)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._store().put(keys, _slots(host_indices, len(keys), self._store().geometry.page_size))

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._store().get(keys, _slots(host_indices, len(keys), self._store().geometry.page_size))

    # SGLang's older, per-tensor interface: not taken with interface_v1.
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> None:
        raise NotImplementedError("cpcache: the store is used through batch_get_v1 (interface_v1)")

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> None:
        raise NotImplementedError("cpcache: the store is used through batch_get_v1 (interface_v1)")

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        raise NotImplementedError("cpcache: the store is used through batch_set_v1 (interface_v1)")

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        raise NotImplementedError("cpcache: the store is used through batch_set_v1 (interface_v1)")

    def close(self) -> None:
        if self.pages is not None:
            self.pages.close()
            self.pages = None


def host_pool_geometry(host_pool: Any) -> tuple[KVGeometry, torch.Tensor]:
    """The KV geometry of an SGLang MHA or MLA host pool, and its buffer with
    the K/V component outermost (`cpcache.host_layout`)."""
    if getattr(host_pool, "layer_num", 0) != getattr(host_pool, "target_layer_num", host_pool.layer_num):
        raise ValueError("cpcache: a host pool with draft-model layers is not supported by the store")
    dtype = dtype_name(host_pool.dtype)
    if hasattr(host_pool, "kv_lora_rank"):  # MLA: one latent, [..., 1, kv_cache_dim] per token
        geometry = KVGeometry(layers=host_pool.layer_num, kv_kind="mla", heads=1, head_dim=host_pool.kv_cache_dim,
                              dtype=dtype, page_size=host_pool.page_size)
        return geometry, host_pool.kv_buffer.unsqueeze(0)
    if host_pool.v_head_dim != host_pool.head_dim:
        raise ValueError(f"cpcache: MHA with v_head_dim {host_pool.v_head_dim} != head_dim {host_pool.head_dim} "
                         "is not supported by the store")
    geometry = KVGeometry(layers=host_pool.layer_num, kv_kind="mha", heads=host_pool.head_num,
                          head_dim=host_pool.head_dim, dtype=dtype, page_size=host_pool.page_size)
    return geometry, host_pool.kv_buffer


def _served_model() -> tuple[str, str]:
    """The default model id and the model dtype, as the prefill's backend
    declares them when it attaches."""
    from sglang.srt.arg_groups.model_override_base import model_config_of
    from sglang.srt.runtime_context import get_server_args

    from cpcache.integrations.sglang.backend import default_model_id, model_dtype_of

    server_args = get_server_args()
    context = SimpleNamespace(model_config=model_config_of(server_args), server_args=server_args)
    return default_model_id(server_args), model_dtype_of(context)


def _slots(host_indices: torch.Tensor, pages: int, page_size: int) -> list[int]:
    """Host slots of `pages` pages from their token indices (page-aligned)."""
    firsts = host_indices.reshape(-1)[: pages * page_size : page_size]
    return [int(i) // page_size for i in firsts.tolist()]
