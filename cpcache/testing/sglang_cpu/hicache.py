"""SGLang's own HiCache on this CPU host, for side-by-side comparisons with
cpcache: its flags (host memory tier; its `file` or Mooncake Store storage
tier beneath) and HICACHE_ENV, which turns on cpu_host/hicache_cpu.py in
every SGLang process of a server started with them (servers.Server)."""

from __future__ import annotations

import json
from pathlib import Path

# SGLang's own HiCache, host tier only: plain-torch copies between the host
# and device pools, which HICACHE_ENV turns on in every SGLang process.
HICACHE_FLAGS = ["--enable-hierarchical-cache", "--hicache-io-backend", "direct",
                 "--hicache-mem-layout", "layer_first", "--hicache-ratio", "2"]
HICACHE_ENV = {"CPCACHE_TEST_HICACHE_CPU": "1"}


def hicache_host_flags(host_pages: int, page_size: int, device_tokens: int) -> list[str]:
    """HICACHE_FLAGS with a host pool of `host_pages` pages (SGLang sizes it
    as a ratio of the device pool), as many as a cpcache host pool's."""
    ratio = HICACHE_FLAGS.index("--hicache-ratio") + 1
    return [*HICACHE_FLAGS[:ratio], f"{host_pages * page_size / device_tokens:g}", *HICACHE_FLAGS[ratio + 1:]]


def hicache_file_storage_flags(root: Path) -> list[str]:
    """SGLang's own storage tier below its HiCache: its `file` backend (one
    file per page and rank under `root`; under attention CP, one per CP rank
    too: its keys always carry the CP rank), prefetching as the suite's
    daemons do (from the first page, until every rank has every page)."""
    return ["--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy", "wait_complete",
            "--hicache-storage-backend-extra-config",
            json.dumps({"file_storage_path": str(root), "prefetch_threshold": 0})]


def hicache_mooncake_flags(master: str, metadata_server: str, segment_bytes: int) -> list[str]:
    """HICACHE_FLAGS with SGLang's Mooncake Store backend below, on a master on
    loopback: `segment_bytes` in all, SGLang dividing it among the TP
    ranks (each mounts its share; under attention CP each CP rank stores
    its own copy of a page). Its zero-copy path needs the page_first_direct
    host layout for an MHA model (cpu_host/hicache_cpu.py binds its copies)."""
    flags = [*HICACHE_FLAGS, "--hicache-storage-backend", "mooncake",
             "--hicache-storage-prefetch-policy", "wait_complete", "--hicache-storage-backend-extra-config",
             json.dumps({"master_server_address": master, "metadata_server": metadata_server,
                         "global_segment_size": segment_bytes, "protocol": "tcp", "local_hostname": "127.0.0.1",
                         "check_server": False, "prefetch_threshold": 0})]
    flags[flags.index("--hicache-mem-layout") + 1] = "page_first_direct"
    return flags
