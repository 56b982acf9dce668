"""Assemble a rank's cache from its settings once a device pool is attached:
host pool, storage backend (with fault injection when asked), movers, the
shared state and this rank's I/O (`CacheRuntime`); bind it to the session
that uses the pool; carry it over into the next epoch."""

from __future__ import annotations

from cpcache.config import DaemonConfig
from cpcache.dataplane.copy_faults import CopyFaults
from cpcache.dataplane.local_io import LocalIO
from cpcache.dataplane.movers import Tiers, Transfers
from cpcache.dataplane.pools import DevicePool, HostPool
from cpcache.dataplane.storage.configured import open_storage
from cpcache.errors import ResourceExhausted
from cpcache.geometry import KVGeometry
from cpcache.keys import ShardingSpec, tenant_of
from cpcache.rank.runtime import CacheRuntime
from cpcache.state.allocator import PageAllocator
from cpcache.state.carryover import KeptPage, restore
from cpcache.state.machine import CacheState


def check_host_budget(config: DaemonConfig, geometry: KVGeometry) -> None:
    """The client's geometry sizes the host pool: refuse it past the budget,
    before anything is allocated."""
    need = geometry.page_bytes * config.host_pool_pages
    if need > config.host_pool_max_bytes:
        raise ResourceExhausted(
            f"attach: {config.host_pool_pages} host pages of {geometry.page_bytes} bytes need {need} bytes, "
            f"more than host_pool_max_bytes ({config.host_pool_max_bytes}); raise it or send a smaller geometry")


def open_runtime(config: DaemonConfig, geometry: KVGeometry, device: DevicePool, model_id: str = "",
                 model_dtype: str = "") -> CacheRuntime:
    check_host_budget(config, geometry)
    topology = config.topology
    coords = topology.coordinates(config.rank)
    host = HostPool(geometry, config.host_pool_pages, config.host_layout)
    storage = open_storage(config, geometry, [(host.address, host.nbytes)])
    copy_faults = CopyFaults(config.faults.copy_delay_ms, config.faults.copy_fail_rate,
                             seed=config.faults.seed * 1000 + config.rank + 500,
                             layer_delay_ms=config.faults.copy_layer_delay_ms,
                             load_fail_layer=config.faults.load_fail_layer)
    # The device pool is not one of the tiers: each session's jobs bind theirs.
    transfers = Transfers(Tiers(host, storage=storage), threads=config.io_threads, copy_faults=copy_faults)
    sharding = ShardingSpec(
        cp=config.kv_cp_sharding,
        tp_sharded_heads=geometry.kv_kind == "mha",
        cp_rank=coords.cp,
        cp_size=topology.cp,
        tp_rank=coords.atp,
        tp_size=topology.atp,
        tenant=tenant_of(model_id, geometry.fingerprint(), model_dtype),
    )
    state = CacheState(config.cache_config, PageAllocator(host.pages), sharding, geometry.page_size, device.pages)
    return CacheRuntime(state, LocalIO(transfers, config.storage_timeout_s))


def start_session(runtime: CacheRuntime, epoch: int, number: int, device: DevicePool) -> CacheRuntime:
    """Issue `runtime`'s jobs in a new session from now on: each binds the
    session's device pool when it is issued (docs/design.md rule 10)."""
    runtime.io.begin_session(epoch, number, device)
    runtime.state.signal_slots = device.signals.slots if device.signals is not None else 0
    return runtime


def carry_over(runtime: CacheRuntime, kept: list[KeptPage], busy: list[int], storage_timeout_s: float) -> CacheRuntime:
    """The runtime a new epoch starts from: the same host pool, storage and
    movers, a fresh shared state holding only `kept` (what every rank
    offered alike), the `busy` slots retired until every rank's I/O on them
    has ended, no open operations, and a fresh record of this rank's I/O."""
    old = runtime.state
    ledger = old.ledger
    state = CacheState(ledger.config, PageAllocator(ledger.allocator.pages), ledger.sharding, ledger.page_size,
                       old.device_pages)
    state.signal_slots = old.signal_slots  # the same session's board
    restore(kept, state.ledger.index, state.ledger.allocator)
    state.carried_over(kept, busy)
    return CacheRuntime(state, runtime.io.renewed(storage_timeout_s))
