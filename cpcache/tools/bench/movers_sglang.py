"""`cpcache bench movers --against sglang`, the part run in SGLang's
environment: the file movers and SGLang's own `HiCacheFile` on the same
pages of one host pool, alternately, in one process.

HiCacheFile is driven as SGLang's cache controller drives it for a file
backend (`_generic_page_set` / `_generic_page_get` in managers/
cache_controller.py, which use the host pool's `get_data_page` and
`set_from_flat_data_page`): a put hands it each page flattened (in the
page_first_direct MHA layout a page is a K run and a V run apart, so
flattening copies it), and `batch_set` writes each to a temp file and
renames it; a get reads each page into a flat page, then copies it into the
pool. Its pages carry no header and no checksum: a torn or foreign file
reads as KV. The cpcache movers frame and check every page.

Prints one JSON object: {"movers": [...]} in the rows of `movers.py`.
"""

from __future__ import annotations

import json
import sys
import tempfile
import uuid
from pathlib import Path

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

from cpcache.dataplane.movers import HOST, STORAGE, Tiers, Transfers
from cpcache.dataplane.pools import HostPool
from cpcache.dataplane.storage import open_backend
from cpcache.tools.bench.movers import BATCH_BYTES, PAGE_SIZES, REPEATS, compare_many, geometry_for, moved


def hicache_file(root: Path) -> HiCacheFile:
    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                  model_name="bench", extra_config={"file_storage_path": str(root)})
    return HiCacheFile(config, file_path=str(root))


def bench(page_bytes: int, tokens: int, work: Path, blocks: int) -> list[dict]:
    geometry = geometry_for(tokens)
    n = max(8, BATCH_BYTES // page_bytes)
    host = HostPool(geometry, pages=n, layout="page_first_direct")
    host.tensor.view(-1).view(torch.uint8).random_(0, 256)
    pages = list(range(n))
    storage = open_backend("file", root=str(work / f"cpcache-{page_bytes}"),
                           geometry_fingerprint=geometry.fingerprint())
    transfers = Transfers(Tiers(host, storage=storage), threads=1)
    sglang = hicache_file(work / f"hicache-{page_bytes}")
    written: dict[str, list[list[str]]] = {"mover": [], "sglang": []}

    def fresh(side: str) -> list[str]:
        names = [f"{uuid.uuid4().hex[:16]}{i:06d}" for i in pages]
        written[side].append(names)
        return names

    def sglang_put() -> None:
        values = [host.stored_bytes(slot)[0].flatten() for slot in pages]  # get_data_page(flat=True)
        if not sglang.batch_set(fresh("sglang"), values):
            raise RuntimeError("bench movers: HiCacheFile refused a page")

    def sglang_get() -> None:
        flat = [torch.empty(page_bytes, dtype=torch.uint8) for _ in pages]  # get_dummy_flat_data_page
        got = sglang.batch_get(written["sglang"][-1], flat)
        for slot, data in zip(pages, got):
            if data is None:
                raise RuntimeError("bench movers: HiCacheFile missed a page it stored")
            page = host.stored_bytes(slot)[0]
            page.copy_(data.view(page.shape))  # set_from_flat_data_page

    try:
        out = []
        put = compare_many(lambda: moved(transfers.submit((HOST, STORAGE), pages, fresh("mover")).result(), n),
                           {"sglang": sglang_put}, n * page_bytes, blocks)
        out.append({"mover": "host->file", "page_bytes": page_bytes, **put})
        get = compare_many(lambda: moved(transfers.submit((STORAGE, HOST), written["mover"][-1], pages).result(), n),
                           {"sglang": sglang_get}, n * page_bytes, blocks)
        out.append({"mover": "file->host", "page_bytes": page_bytes, **get})
        return out
    finally:
        transfers.close()


def main() -> None:
    blocks = int(sys.argv[1]) if len(sys.argv) > 1 else REPEATS
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="cpc-movers-sglang-") as tmp:
        for page_bytes, tokens in PAGE_SIZES.items():
            rows += bench(page_bytes, tokens, Path(tmp), blocks)
    print(json.dumps({"movers": rows}))


if __name__ == "__main__":
    main()
