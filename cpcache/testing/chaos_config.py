"""What a chaos run (`chaos.py`) is set up with: its settings, the model
and geometry every rank attaches with, and the domain of real daemons it
launches, each rank's storage and copies slowed its own way."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cpcache.testing.chaos_faults import KINDS
from cpcache.topology import Topology

if TYPE_CHECKING:
    from cpcache.daemon.launcher import DomainSpec
    from cpcache.geometry import KVGeometry

# The command line parses without torch: what needs it is imported when a run starts.
MODEL = "chaos"
PAGE_SIZE = 16


@functools.cache
def geometry() -> KVGeometry:
    from cpcache.geometry import KVGeometry

    return KVGeometry(layers=2, kv_kind="mha", heads=1, head_dim=16, dtype="bfloat16", page_size=PAGE_SIZE)


# Per-rank perturbation (rank % 4): (storage delay ms, copy delay ms), so that
# operations are open, and ranks' I/O ends at different times, when a fault lands.
RANK_DELAYS = {0: (0.0, 0.0), 1: (20.0, 4.0), 2: (5.0, 1.0), 3: (10.0, 2.0)}


@dataclass
class ChaosConfig:
    tp: int = 4
    cp: int = 2
    minutes: float = 1.5
    seed: int = 1
    agreement_timeout_s: float = 2.0
    call_timeout_s: float = 8.0  # the schedulers' call deadline: above the agreement timeout + 5 s
    fault_every_s: float = 8.0
    kinds: tuple[str, ...] = KINDS
    iteration_ms: float = 10.0  # the shortest scheduler iteration (a forward pass)
    reattach_after: int = 16  # the backend's reattach_after_iterations
    settle_s: float = 180.0  # after the faults, longest wait for every rank to be attached again (beyond the
    # daemons' own rendezvous_timeout_s, 120 s: a domain forming again may take that long)
    device_pages: int = 256
    host_pool_pages: int = 64
    flood_streams: int = 256
    flood_calls: int = 64
    hang_s: float = 0.0  # 0: call_timeout_s x (2 + ranks) + OUTCOME_WAIT_S + 30
    run_dir: Path | None = None
    keep_run_dir: bool = False

    @property
    def topology(self) -> Topology:
        return Topology(tp=self.tp, cp=self.cp)


def domain_spec(cfg: ChaosConfig, run_dir: Path) -> DomainSpec:
    from cpcache.daemon.launcher import DomainSpec

    per_rank = {rank: dict(fault_storage_delay_ms=RANK_DELAYS[rank % 4][0],
                           fault_copy_delay_ms=RANK_DELAYS[rank % 4][1], fault_seed=cfg.seed * 100 + rank)
                for rank in range(cfg.topology.world_size)}
    return DomainSpec(cfg.topology, run_dir, agreement_timeout_s=cfg.agreement_timeout_s, seed=cfg.seed,
                      extra=dict(storage="file", storage_root=str(run_dir / "pages"),
                                 host_pool_pages=cfg.host_pool_pages, prefetch_threshold_tokens=PAGE_SIZE),
                      per_rank=per_rank)
