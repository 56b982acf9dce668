"""cpcache as an SGLang radix-cache backend: ``--radix-cache-backend cpcache``.

SGLang loads the general plugins of the entry-point group
``sglang.srt.plugins`` in every process it starts, its spawned schedulers
included; installing cpcache registers `register` there, so a plain
``python -m sglang.launch_server ... --radix-cache-backend cpcache`` finds the
backend. The flags it needs, and why, are in docs/sglang.md.

The backend's settings come from the file named by ``CPCACHE_SGLANG_CONFIG``
(see `settings.Settings`).
"""

from __future__ import annotations

from typing import Any

NAME = "cpcache"


def register() -> None:
    """Register the `cpcache` backend with SGLang, and have SGLang's KV pool
    allocated where the daemon can map it (on hosts without CUDA, shared
    memory; `shared_memory`), before any pool exists. Once; later calls do
    nothing."""
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    from cpcache.integrations.sglang import shared_memory

    shared_memory.install()
    if get_radix_cache_factory(NAME) is None:
        register_radix_cache_backend(NAME, build)


def build(context: Any) -> Any:
    """SGLang's factory: a `TreeCacheBuildContext` in, the radix cache out."""
    from cpcache.integrations.sglang.backend import build_cache

    return build_cache(context)
