"""What the `cpcache` backend needs of SGLang's server arguments, checked
when SGLang builds the cache: a configuration SGLang would not drive refuses
to start with an error that names the flag, instead of serving and hanging.

- ``--enable-hierarchical-cache``: SGLang's scheduler calls its cache's
  per-iteration hook (`check_hicache_events`, where cpcache sends the
  iteration's one Step) only then. Without it no write is ever decided, its
  device pages stay locked, and once the pool fills no request is admitted.
- ``--hicache-storage-backend dynamic`` with cpcache named in
  ``--hicache-storage-backend-extra-config`` (`STORAGE_EXTRA_CONFIG`): the
  scheduler asks the cache for storage prefetches only when a storage backend
  is named. cpcache's daemon is the storage tier; SGLang's own storage code
  is never built (a decode server builds it for its offload:
  `storage.CpcacheStore`). Without it cpcache serves the host tier only.
"""

from __future__ import annotations

import json
from typing import Any

from cpcache.deprecations import deprecated

# The storage flag's extra config that names cpcache's daemon as the tier.
STORAGE_EXTRA_CONFIG = {"backend_name": "cpcache", "module_path": "cpcache.integrations.sglang.storage",
                        "class_name": "CpcacheStore", "interface_v1": 1}
# The storage class's names before 0.2.0 (old -> new): still loaded, with a warning.
RENAMED_CLASSES = {"DaemonStorage": "CpcacheStore"}
RENAMED_HINT = ' (give "class_name": "{new}" in --hicache-storage-backend-extra-config)'


# Why a decode server cannot run over the backend (SGLang 0.5.23).
DECODE_REFUSED = (
    "cpcache: --radix-cache-backend cpcache is for aggregated and prefill servers, not a decode server "
    "(--disaggregation-mode decode). A decode server has a radix cache only with "
    "--disaggregation-decode-enable-radix-cache, and with --enable-hierarchical-cache (which the backend needs) "
    "SGLang's decode-side restore (disaggregation/decode_hicache_mixin.py) drives HiCache's own radix tree and "
    "controller directly (cache_controller.layer_done_counter, has_free_load_back_slot, query_storage_hit_length, "
    "prefetch_from_storage with its hash chain, is_load_back_event_done), not the radix-cache backend interface; "
    "without that flag the decode server keeps no cache at all. To share what the decode server generates, run it "
    "without this backend and with --disaggregation-decode-enable-offload-kvcache over cpcache's store "
    "(docs/sglang.md, \"Prefill and decode apart\")")


class UnsupportedServer(ValueError):
    """SGLang's server arguments ask for something the backend cannot do."""


def _storage_extra_config(server_args: Any) -> dict:
    raw = getattr(server_args, "hicache_storage_backend_extra_config", None)
    if not raw:
        return {}
    try:
        extra = json.loads(raw) if isinstance(raw, str) else dict(raw)
    except (ValueError, TypeError):
        return {}
    return extra if isinstance(extra, dict) else {}


def _storage_named_cpcache(server_args: Any) -> bool:
    return _storage_extra_config(server_args).get("backend_name") == "cpcache"


def warn_renamed_class(server_args: Any) -> None:
    """A storage class named by its name before 0.2.0 still serves; say so.
    (SGLang builds the class only on a decode server, where loading it by
    the old name warns too: `storage.__getattr__`.)"""
    old = _storage_extra_config(server_args).get("class_name")
    if _storage_named_cpcache(server_args) and old in RENAMED_CLASSES:
        module = STORAGE_EXTRA_CONFIG["module_path"]
        new = RENAMED_CLASSES[old]
        deprecated(f"cpcache: {module}.{old} is deprecated; it is now {module}.{new}{RENAMED_HINT.format(new=new)}")


def storage_prefetch_enabled(server_args: Any) -> bool:
    """Whether SGLang's scheduler will ask for storage prefetches; refuses a
    storage backend other than cpcache's (SGLang's would never be used)."""
    backend = getattr(server_args, "hicache_storage_backend", None)
    if backend is None:
        return False
    if backend != "dynamic" or not _storage_named_cpcache(server_args):
        raise UnsupportedServer(
            f"cpcache: --hicache-storage-backend {backend} is SGLang's own storage, which the cpcache backend "
            "does not use (its daemon is the storage tier). Use --hicache-storage-backend dynamic "
            f"--hicache-storage-backend-extra-config '{json.dumps(STORAGE_EXTRA_CONFIG)}', or leave both out "
            "to serve the host tier only")
    return True


def check(context: Any) -> None:
    """Refuse what the backend cannot serve, naming the flag."""
    server_args = context.server_args
    if getattr(server_args, "disaggregation_mode", "null") == "decode":
        raise UnsupportedServer(DECODE_REFUSED)
    if context.disable_radix_cache:
        raise UnsupportedServer("cpcache: --radix-cache-backend cpcache with --disable-radix-cache caches nothing; "
                                "drop one of them")
    if not context.enable_hierarchical_cache:
        raise UnsupportedServer(
            "cpcache: --radix-cache-backend cpcache needs --enable-hierarchical-cache: SGLang's scheduler calls "
            "the cache once per iteration (check_hicache_events) only then, and cpcache decides every write, "
            "load and prefetch in that call; without it writes are never decided, their pages stay locked "
            "and the server stops admitting requests once the KV pool fills")
    # DSA (DeepSeek V3.2) is served: its indexer keys are a part of every
    # page beside the KV (`pool.geometry_of`), moved and stored with it.
    if context.is_hybrid_swa or context.is_hybrid_ssm:
        raise UnsupportedServer("cpcache: hybrid sliding-window and Mamba models are not supported "
                                "(their extra cache components have no tier below the device)")
    if getattr(server_args, "dp_size", 1) > 1 and not getattr(server_args, "enable_dp_attention", False):
        raise UnsupportedServer(
            f"cpcache: --dp-size {server_args.dp_size} without --enable-dp-attention runs a separate world per "
            "replica, whose ranks would share daemons; run one server per replica, each over its own daemons")
    if getattr(server_args, "dcp_size", 1) > 1:
        raise UnsupportedServer("cpcache: decode context parallelism (--dcp-size) shards tokens across ranks, "
                                "which cpcache's pages do not describe")
    if getattr(server_args, "enable_unified_memory", False):
        raise UnsupportedServer("cpcache: --enable-unified-memory moves KV rows under the daemon's copies")
    if getattr(server_args, "speculative_algorithm", None):
        raise UnsupportedServer("cpcache: speculative decoding's KV (EAGLE's bigram keys) has no tier below the "
                                "device; serve without --speculative-algorithm")
    mode = getattr(server_args, "hicache_host_memory_mode", "cache")
    if mode != "cache":
        raise UnsupportedServer(f"cpcache: --hicache-host-memory-mode {mode} is not supported; the daemon's host "
                                "pool is a cache tier (leave the flag at its default, cache)")
    storage_prefetch_enabled(server_args)
    warn_renamed_class(server_args)
