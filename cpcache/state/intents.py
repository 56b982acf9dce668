"""What the state machine tells this rank's data plane to do, and what it
tells the scheduler. Intents are typed values keyed by the operation's
serial (unique for the life of the state, never reused)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from cpcache.keys import ShardingSpec

# Storage keys are formatted when the I/O starts, not when the state decides
# it: a round's I/O mostly starts after its step has answered.


@dataclass(frozen=True)
class Lookup:
    """How many of `pages`' keys, from the first, are in storage."""

    serial: int
    pages: tuple[bytes, ...]
    sharding: ShardingSpec

    @functools.cached_property
    def keys(self) -> tuple[str, ...]:
        return self.sharding.storage_keys(self.pages)


@dataclass(frozen=True)
class Fetch:
    """Storage -> host, into `slots`."""

    serial: int
    pages: tuple[bytes, ...]
    slots: tuple[int, ...]
    sharding: ShardingSpec

    @functools.cached_property
    def keys(self) -> tuple[str, ...]:
        return self.sharding.storage_keys(self.pages)


@dataclass(frozen=True)
class CopyToHost:
    """Device -> host (a write-through)."""

    serial: int
    device_pages: tuple[int, ...]
    slots: tuple[int, ...]


@dataclass(frozen=True)
class Store:
    """Host -> storage (a backup) of `pages`, in `page_slots`; `keys` and
    `slots` are this rank's share (`ShardingSpec.writes`)."""

    serial: int
    pages: tuple[bytes, ...]
    page_slots: tuple[int, ...]
    sharding: ShardingSpec

    @functools.cached_property
    def _share(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        return self.sharding.share(self.pages, self.page_slots)

    @property
    def keys(self) -> tuple[str, ...]:
        return self._share[0]

    @property
    def slots(self) -> tuple[int, ...]:
        return self._share[1]


@dataclass(frozen=True)
class CopyToDevice:
    """Host -> device (a load-back); `op_id` is the scheduler's, for WaitLoads."""

    serial: int
    op_id: int
    slots: tuple[int, ...]
    device_pages: tuple[int, ...]
    signal_slot: int = 0  # the load-signal slot its layers are published in (0: none)


Intent = Lookup | Fetch | CopyToHost | Store | CopyToDevice


@dataclass
class Decisions:
    """What the scheduler is told, by its own op ids."""

    prefetch_hits: list[tuple[int, int]] = field(default_factory=list)  # (op, pages in storage)
    prefetch_done: list[tuple[int, int]] = field(default_factory=list)  # (op, pages accepted)
    prefetch_revoked: list[tuple[int, str]] = field(default_factory=list)  # (op, why)
    write_acks: list[int] = field(default_factory=list)
    write_failures: list[int] = field(default_factory=list)  # copies that failed on some rank
    backups: list[tuple[int, bool]] = field(default_factory=list)  # (backup id, stored)
    # The pages of each backup of `backups`, in its order (the reply names
    # them); not compared: a function of the backup, which `backups` names.
    backup_pages: list[tuple[bytes, ...]] = field(default_factory=list, compare=False)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (op, pages loaded)
    load_failures: list[int] = field(default_factory=list)  # copies that failed on some rank
    host_entered: list[bytes] = field(default_factory=list)  # pages now resident in the host pool
    host_entered_slots: list[int] = field(default_factory=list)  # the slot of each
    host_left: list[bytes] = field(default_factory=list)  # pages no longer resident
    # The backups the daemon opened itself still open after the round
    # (`CacheState.daemon_open`): the rounds that decide them wait for steps. Not
    # compared: a function of the agreed state, which the digest covers.
    daemon_open: int = field(default=0, compare=False)

    def merge(self, other: Decisions) -> Decisions:
        for name, values in vars(other).items():
            if isinstance(values, list):
                getattr(self, name).extend(values)
        return self

    def count(self) -> int:
        return sum(len(v) for name, v in vars(self).items() if isinstance(v, list) and name != "backup_pages")
