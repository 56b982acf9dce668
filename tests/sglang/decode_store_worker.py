"""Run in SGLang's environment by test_decode_store.py: `CpcacheStore` built
as SGLang's storage factory builds it, with SGLang's own storage config,
over a stand-in of SGLang's server arguments and host pool. Prints one JSON
line of outcomes."""

from __future__ import annotations

import json
import sys
import warnings
from types import SimpleNamespace

import torch
from sglang.srt import runtime_context
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName
from sglang.srt.mem_cache.storage import StorageBackendFactory

from cpcache.integrations.sglang import storage
from cpcache.integrations.sglang.server_flags import STORAGE_EXTRA_CONFIG


def config(extra: dict | None = None, attn_cp_size: int = 1) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=attn_cp_size, is_mla_model=False, enable_storage_metrics=False,
                                is_page_first_layout=False, model_name="tiny",
                                extra_config=dict(STORAGE_EXTRA_CONFIG) if extra is None else extra)


def refused(mode: str, **options: object) -> str:
    runtime_context.get_server_args = lambda: SimpleNamespace(disaggregation_mode=mode)
    try:
        storage.CpcacheStore(config(**options))  # type: ignore[arg-type]
    except ValueError as exc:
        return str(exc)
    return ""


def host_pool() -> SimpleNamespace:
    layers, heads, dim, page, pages = 2, 2, 4, 4, 8
    buffer = torch.arange(2 * layers * pages * page * heads * dim, dtype=torch.float32)
    return SimpleNamespace(layer_num=layers, target_layer_num=layers, dtype=torch.float32, head_num=heads,
                           head_dim=dim, v_head_dim=dim, page_size=page, layout="layer_first",
                           kv_buffer=buffer.view(2, layers, pages * page, heads, dim))


def by_old_name(keys: list[str]) -> dict[str, object]:
    """The class's name before 0.2.0 in the extra config, built as SGLang's
    cache controller builds a dynamic backend: its factory, then the host
    pool registered."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = StorageBackendFactory.create_backend(
            "dynamic", config({**STORAGE_EXTRA_CONFIG, "class_name": "DaemonStorage"}), host_pool())
        old.register_mem_pool_host(host_pool())
    found = old.batch_exists(keys)
    old.close()
    return {"class": type(old).__name__, "found": found,
            "warnings": [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)
                         and "DaemonStorage" in str(w.message)]}


def main() -> None:
    out: dict[str, object] = {
        "aggregated": refused("null"),
        "no_interface_v1": refused("decode", extra={k: v for k, v in STORAGE_EXTRA_CONFIG.items()
                                                    if k != "interface_v1"}),
        "attention_cp": refused("decode", attn_cp_size=2),
    }
    runtime_context.get_server_args = lambda: SimpleNamespace(disaggregation_mode="decode")
    storage._served_model = lambda: ("tiny", "float32")  # what the prefill's backend would declare
    store = storage.CpcacheStore(config())
    store.register_mem_pool_host(host_pool())
    try:  # DSA's indexer keys, registered as SGLang registers a second part of each page
        store.register_mem_host_pool_v2(host_pool(), PoolName.INDEXER)
        out["indexer_part"] = ""
    except ValueError as exc:
        out["indexer_part"] = str(exc)
    keys = ["ab" * 32, "cd" * 32]
    written = store.batch_set_v1(keys, torch.arange(0, 8))
    out["store"] = {"written": written, "found": store.batch_exists(keys), "open": store.pages is not None}
    store.close()
    out["old_name"] = by_old_name(keys)
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
