"""The storage backend a daemon's settings choose, with its fault injection:
opened alike by a rank's daemon (over its host pool) and by a process that
writes the same store directly (SGLang's decode offload, over its own host
pool), so both frame, key and check pages the same way."""

from __future__ import annotations

from cpcache.config import DaemonConfig
from cpcache.dataplane.storage import StorageBackend, open_configured
from cpcache.dataplane.storage.faults import FaultyBackend, StorageFaults
from cpcache.geometry import KVGeometry


def open_storage(config: DaemonConfig, geometry: KVGeometry,
                 buffers: list[tuple[int, int]]) -> StorageBackend | None:
    """The chosen backend, given its own settings only; `buffers`: the
    (address, nbytes) of host memory pages move from and into (Mooncake
    registers them with its transfer engine)."""
    if config.storage == "none":
        return None
    backend = open_configured(config, geometry, buffers)
    faults = StorageFaults(
        delay_ms=config.faults.storage_delay_ms,
        fail_rate=config.faults.storage_fail_rate,
        truncate_rate=config.faults.storage_truncate_rate,
        seed=config.faults.seed * 1000 + config.rank,
    )
    return FaultyBackend(backend, faults) if faults.active else backend
