"""cpcache as an SGLang radix-cache backend: ``--radix-cache-backend cpcache``.

SGLang finds backends in its registry; this package registers itself there
when `register()` runs. Run it once in the server's process before SGLang
builds its cache, for instance from a `sitecustomize` module or a launcher:

    python -c "import cpcache.integrations.sglang as c; c.register(); \\
               import runpy; runpy.run_module('sglang.launch_server', run_name='__main__')" \\
        --model-path ... --page-size 16 --radix-cache-backend cpcache

The backend's settings come from the file named by ``CPCACHE_SGLANG_CONFIG``
(see `settings.Settings`).
"""

from __future__ import annotations

from typing import Any

NAME = "cpcache"


def register() -> None:
    """Register the `cpcache` backend with SGLang (once; later calls do nothing)."""
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    if get_radix_cache_factory(NAME) is None:
        register_radix_cache_backend(NAME, build)


def build(context: Any) -> Any:
    """SGLang's factory: a `TreeCacheBuildContext` in, the radix cache out."""
    from cpcache.integrations.sglang.backend import build_cache

    return build_cache(context)
