"""cpcache's store as SGLang's HiCache storage backend, for a decode server:
its KV offload (`--disaggregation-decode-enable-offload-kvcache`) writes the
pages it generated into the prefill domain's store, under the keys the
prefill's daemons read, so the next turn's prefill finds the previous
answer there.

Named by the same flags as the prefill's storage tier
(`server_flags.STORAGE_EXTRA_CONFIG`). With ``--radix-cache-backend
cpcache`` SGLang never builds this class: the rank's daemon is the storage
tier. SGLang builds it for a decode server's offload, and, if an operator
forgets the backend flag, for its own HiCache on another server: refused
there, since SGLang's HiCache keys pages by its full TP rank under attention
CP, not as the daemons do. It needs two of the backend's settings
(`settings.Settings`, ``CPCACHE_SGLANG_CONFIG``): `daemon_config`, the
domain's settings file (the store, its sharding), and `model_id` when the
prefill's is not the default.

SGLang picks the writer of a replicated (MLA) page itself (its storage
config's `is_storage_writer`: TP rank 0); every page handed to this class
is written. A store that cannot be reached costs the offload, not the
decode server: while it cannot be opened every call is a miss, and it is
tried again every `REOPEN_AFTER_S` (the first failure logged as an error,
the next ones at debug level). Once open, a store that goes away fails the
writes (SGLang logs them) until it is back. Every call, the opening
included, is given up at the domain's `storage_timeout_s`
(`store_calls.BoundedCalls`): a store that stops answering costs SGLang's
backup thread that long once, then nothing until it answers again.

SGLang imports this module only in its own processes: it subclasses
SGLang's `HiCacheStorage`. Its name before 0.2.0, `DaemonStorage`, still
loads it, with a `DeprecationWarning` (CHANGELOG.md, "Deprecated").
"""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from cpcache.deprecations import renamed_attributes
from cpcache.errors import CacheError, Unavailable
from cpcache.integrations.sglang.pool import pool_name
from cpcache.integrations.sglang.server_flags import RENAMED_CLASSES, RENAMED_HINT
from cpcache.integrations.sglang.settings import Settings
from cpcache.integrations.sglang.store_calls import BoundedCalls, CallGuard
from cpcache.integrations.sglang.store_pages import StorePages, client_config, host_pool_geometry, page_slots
from cpcache.keys import ShardingSpec, tenant_of

log = logging.getLogger(__name__)
REOPEN_AFTER_S = 30.0


class CpcacheStore(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        from sglang.srt.runtime_context import get_server_args

        extra = storage_config.extra_config or {}
        if getattr(get_server_args(), "disaggregation_mode", "null") != "decode":
            raise ValueError("cpcache: this storage backend is the daemons' tier: serve with --radix-cache-backend "
                             "cpcache (SGLang's own HiCache over it is for a decode server's offload only, "
                             "--disaggregation-mode decode)")
        if not extra.get("interface_v1"):
            raise ValueError("cpcache: the store moves pages by host index; add \"interface_v1\": 1 to "
                             "--hicache-storage-backend-extra-config")
        if storage_config.dcp_size > 1 or storage_config.pp_size > 1 or storage_config.attn_cp_size > 1:
            raise ValueError("cpcache: the store does not describe a decode server's pages split by --dcp-size, "
                             "--pp-size or --attn-cp-size")
        self.settings = Settings.load()
        if not self.settings.daemon_config:
            raise ValueError("cpcache: the store to write is the domain's: set daemon_config, the prefill "
                             "daemons' settings file, in the file CPCACHE_SGLANG_CONFIG names")
        self.config = client_config(self.settings.daemon_config, self.settings.store_hostname)
        self.storage_config = storage_config
        self.calls = BoundedCalls(self.config.storage_timeout_s)
        self.pages: StorePages | None = None
        self._opened: tuple[Any, ...] | None = None  # what `_open` needs, once SGLang registered its host pool
        self._lock = threading.Lock()
        self._retry_at = 0.0
        self._failures = 0

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        try:
            geometry, host = host_pool_geometry(mem_pool_host)
        except CacheError as exc:
            raise ValueError(f"cpcache: {exc}; serve the decode server's offload with --hicache-mem-layout "
                             "layer_first, page_first or page_first_direct") from None
        self._opened = (geometry, host, mem_pool_host.layout)
        self.calls.call("the store's opening", lambda _guard: self._store(), None)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """SGLang registers each part of a page as a host pool of its own
        (DSA's indexer keys beside the KV). A stored page holds the KV only:
        a second part is refused, or a later hit would pair its KV with no
        indexer keys."""
        if pool_name(host_pool_name) != "kv":
            raise ValueError(f"cpcache: the decode server's pool keeps {pool_name(host_pool_name)} beside each "
                             "page's KV, which cpcache's store does not hold: serve its offload with another "
                             "storage backend")
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def _open(self) -> None:
        """Open the store, or log why not and serve misses until it opens."""
        assert self._opened is not None
        geometry, host, layout = self._opened
        model_id, model_dtype = _served_model()
        sharding = ShardingSpec(cp=self.config.kv_cp_sharding, tp_sharded_heads=geometry.kv_kind == "mha",
                                tp_rank=self.storage_config.tp_rank, tp_size=self.storage_config.tp_size,
                                tenant=tenant_of(self.settings.model_id or model_id, geometry.fingerprint(),
                                                 model_dtype))
        try:
            self.pages = StorePages.open(self.config, geometry, sharding, host, layout)
        except (Unavailable, OSError) as exc:  # the store is down or unwritable; bad settings fail the start
            self._retry_at = time.monotonic() + REOPEN_AFTER_S
            self._failures += 1
            log.log(logging.ERROR if self._failures == 1 else logging.DEBUG,
                    "cpcache: the store (%s) cannot be opened, the decode server offloads nothing until it can "
                    "(tried again every %g s): %s", self.config.storage, REOPEN_AFTER_S, exc)
            return
        log.info("cpcache: store %s for %r (%s), tenant %s, keys ending %r", self.config.storage,
                 self.settings.model_id or model_id, model_dtype, sharding.tenant, sharding.suffix())

    def _store(self) -> StorePages | None:
        """The store, or None while it cannot be opened (tried again every
        REOPEN_AFTER_S)."""
        with self._lock:
            if self.pages is None and self._opened is not None and time.monotonic() >= self._retry_at:
                self._open()
            return self.pages

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        def exists(_guard: CallGuard) -> int:
            store = self._store()
            return store.exists_prefix(keys) if store is not None else 0

        return self.calls.call(f"a lookup of {len(keys)} pages", exists, 0)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        def put(guard: CallGuard) -> list[bool]:
            store = self._store()
            if store is None:
                return [False] * len(keys)
            return store.put(keys, page_slots(host_indices, len(keys), store.geometry.page_size), guard)

        return self.calls.call(f"a write of {len(keys)} pages", put, [False] * len(keys))

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        def get(guard: CallGuard) -> list[bool]:
            store = self._store()
            if store is None:
                return [False] * len(keys)
            return store.get(keys, page_slots(host_indices, len(keys), store.geometry.page_size), guard)

        return self.calls.call(f"a read of {len(keys)} pages", get, [False] * len(keys))

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
        if self.calls.stalled:  # a call given up may still be in the store's client: leave it to the exit
            log.warning("cpcache: the store is left open at close: a call given up on has not returned")
            return
        with self._lock:
            if self.pages is not None:
                self.pages.close()
                self.pages = None


def _served_model() -> tuple[str, str]:
    """The default model id and the model dtype, as the prefill's backend
    declares them when it attaches."""
    from sglang.srt.arg_groups.model_override_base import model_config_of
    from sglang.srt.runtime_context import get_server_args

    from cpcache.integrations.sglang.backend import default_model_id, model_dtype_of

    server_args = get_server_args()
    context = SimpleNamespace(model_config=model_config_of(server_args), server_args=server_args)
    return default_model_id(server_args), model_dtype_of(context)


# The class's name before 0.2.0, which an operator's
# --hicache-storage-backend-extra-config may still give as its "class_name"
# (SGLang's loader takes the class by getattr): it resolves, with a warning.
__getattr__ = renamed_attributes(__name__, globals(), RENAMED_CLASSES, hint=RENAMED_HINT)
